"""`qwen3-tts bench first-chunk`: the first chunk's size (1, 2 or 4 frames) in both text modes.

One scheduler in this process (the worker's synthesis, no HTTP: what the size changes is compute),
one clock. Text comes as an LLM writes it, `--tokens-per-s` pieces of ~3 characters a second:
- sentences: the engine gets the sentence once the LLM has written all of it (POST's layout);
- stream: the engine gets each piece as it is written (the WebSocket's dual-track layout);
- stream_fast_llm: the same with an LLM ten times faster, whose text stays ahead of the engine
  (a stream that waits for text sends the frames it has, so a slow LLM makes the first chunk
  small whatever size is asked).
Per mode and size: first audio from when the engine got text ("engine"), and from the LLM's first
piece ("from_llm"; the same for the stream mode), the whole utterance's compute, and the seams:
the streamed audio against a one-shot decode of the same codes (max abs difference at the chunk
joins, +-`JOIN_SAMPLES`, and elsewhere, in int16 steps), and the gaps a player starting at the
first chunk would hear when a later chunk comes after the audio before it has played. Sizes run interleaved, the same seeds.
JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from qwen3_tts_engine.audio import leading_silence_s
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.scheduler import Scheduler
from qwen3_tts_engine.worker.synthesis import one_shot_decode

TEXT = "Hello there, how are you today? I can help with that right away."
SIZES = (1, 2, 4)
# mode -> (how the engine gets the text, the LLM's speed as a multiple of --tokens-per-s)
MODES = {
    "sentences": ("sentences", 1.0),
    "stream": ("stream", 1.0),
    "stream_fast_llm": ("stream", 10.0),
}
FRAME_S = 0.08  # audio per frame
JOIN_SAMPLES = 240  # 10 ms either side of a chunk join


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _one(model, mode: str, frames: int, seed: int, rate: float, max_frames: int) -> dict:
    """One utterance; times on one clock from the LLM's first piece (t0)."""
    pieces = _pieces(TEXT)
    arrival = [i / rate for i in range(len(pieces))]  # when the LLM has written piece i
    scheduler = Scheduler(model, max_batch=1)
    common = dict(voice="ryan", language="english", seed=seed, first_chunk_frames=frames,
                  max_new_tokens=max_frames)  # fmt: skip
    chunks, codes, arrived = [], [], []
    t0 = time.perf_counter()
    if mode == "sentences":  # the whole sentence, once written
        time.sleep(arrival[-1])
        got_text = time.perf_counter() - t0
        scheduler.add("u", SpeechRequest(input=TEXT, **common), keep_codes=True)
        sent, ended = len(pieces), True
    else:
        got_text = 0.0
        scheduler.add("u", SpeechRequest(input="", text_stream=True, **common), keep_codes=True)
        sent, ended = 0, False
    first = None
    done = False
    while not done:
        now = time.perf_counter() - t0
        while sent < len(pieces) and arrival[sent] <= now:
            scheduler.append_text("u", pieces[sent])
            sent += 1
        if not ended and sent == len(pieces):
            scheduler.end_text("u")
            ended = True
        if not scheduler.runnable and sent < len(pieces):  # waiting for text: until it is written
            time.sleep(max(0.0, arrival[sent] - (time.perf_counter() - t0)))
            continue
        for ev in scheduler.step():
            if ev.kind == "chunk":
                arrived.append(time.perf_counter() - t0)
                first = first if first is not None else arrived[-1]
                chunks.append(ev.chunk)
                codes.append(ev.chunk.codes)
            elif ev.kind == "error":
                raise ev.error
            else:
                done = True
    total = time.perf_counter() - t0
    streamed = np.concatenate([c.audio for c in chunks])
    whole = one_shot_decode(model, np.concatenate(codes)).reshape(-1)[: len(streamed)]
    diff = np.abs(streamed.astype(np.float64) - whole.astype(np.float64)) * 32767
    joins = np.cumsum([len(c.audio) for c in chunks])[:-1]
    near = np.zeros(len(diff), bool)
    for j in joins:
        near[max(0, j - JOIN_SAMPLES) : j + JOIN_SAMPLES] = True
    return {
        "gaps_s": _gaps(arrived, [c.frames for c in chunks]),
        "first_audio_engine_s": first - got_text, "first_audio_from_llm_s": first,
        # + the audio's leading silence: when a listener, playing from the first chunk, hears it
        "first_audible_engine_s": first - got_text + leading_silence_s(streamed),
        "total_s": total, "compute_s": sum(c.compute_s for c in chunks), "frames": sum(c.frames for c in chunks),
        "chunk_frames": [c.frames for c in chunks],
        "seam_max_abs_int16": float(diff[near].max()) if near.any() else 0.0,
        "elsewhere_max_abs_int16": float(diff[~near].max()) if (~near).any() else 0.0,
    }  # fmt: skip


def _gaps(arrived: list[float], frames: list[int]) -> float:
    """Silence a player adds when it starts at the first chunk and a later one comes late."""
    end, gaps = arrived[0], 0.0  # when the audio queued so far finishes playing
    for t, n in zip(arrived, frames, strict=True):
        gaps += max(0.0, t - end)
        end = max(end, t) + n * FRAME_S
    return gaps


def _summary(runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in
           ("first_audio_engine_s", "first_audible_engine_s", "first_audio_from_llm_s", "total_s",
            "compute_s", "gaps_s")}  # fmt: skip
    return {**med, "n": len(runs), "frames": runs[0]["frames"],
            "chunk_frames": runs[0]["chunk_frames"],
            "seam_max_abs_int16": max(r["seam_max_abs_int16"] for r in runs),
            "elsewhere_max_abs_int16": max(r["elsewhere_max_abs_int16"] for r in runs)}  # fmt: skip


def run_first_chunk_bench(args: argparse.Namespace) -> int:
    path = args.model or str(default_tiny_checkpoint("custom_voice"))
    model, _ = load(resolve(path), progress=False)
    _one(model, "stream", 4, 0, args.tokens_per_s, args.frames)  # warm-up: compiled kernels
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.repeats):
        for mode, (how, speed) in MODES.items():
            for frames in SIZES if r % 2 == 0 else SIZES[::-1]:  # interleaved, both orders
                res = _one(model, how, frames, 100 + r, args.tokens_per_s * speed, args.frames)
                runs.setdefault((mode, frames), []).append(res)
    out: dict = {"model": Path(path).name, "text": TEXT, "tokens_per_s": args.tokens_per_s,
                 "max_frames": args.frames, "repeats": args.repeats}  # fmt: skip
    for mode in MODES:
        table = {str(f): _summary(runs[(mode, f)]) for f in SIZES}
        four = table["4"]["first_audio_engine_s"]
        for row in table.values():
            row["first_audio_vs_4"] = row["first_audio_engine_s"] / four
            row["compute_vs_4"] = row["compute_s"] / table["4"]["compute_s"]
        out[mode] = table
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.stdout.flush()
    return 0
