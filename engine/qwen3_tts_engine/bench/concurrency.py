"""`qwen3-tts bench concurrency`: many streams on one loaded model (continuous batching), as JSON.

Per concurrency level (all streams start together, different texts and seeds):
- codes path, in this process: the scheduler alone with `decode=False` (talker + code
  predictor: what batching changes), and the same requests one after another through a
  scheduler of batch 1 (what a handler without batching did);
- full path, in this process: the same with the vocoder, and where a step's time goes;
- HTTP path: streaming clients against a server whose handler batches (`--max-batch`).
The codes path also says whether batching changed any stream's codes (the same seeded requests
batched and one by one: streams whose codes differ, and the first frame where they do) and how
much mlx memory each extra stream adds at the peak (talker KV, activations, vocoder state).
Each level reports first audio p50/p95 (the first chunk's arrival) and, where there is audio
(the full and HTTP paths), first audible p50/p95 (the first chunk + the audio's leading silence,
`audio.leading_silence_s`, as Coval's TTS benchmark counts it), per-stream real-time factor (wall time / audio
duration) and aggregate frames per second; `realtime_slots`, the streams one engine keeps in real
time by the server's measured steps (what `serve`'s frame budget admits: sizing a fleet); `ratios` divides each level by the 1-stream level of
the same path in the same run (compare ratios, not seconds: the machines are shared).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np

from qwen3_tts_engine.audio import leading_silence_s
from qwen3_tts_engine.bench.memory import real_size_dir, write_real_size_checkpoint
from qwen3_tts_engine.config import EngineConfig, build_server
from qwen3_tts_engine.dispatch.capacity import FRAME_S, StepModel
from qwen3_tts_engine.models.checkpoints import cache_root
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import FRAME_RATE, SAMPLE_RATE, SpeechRequest, compute_dtype_option
from qwen3_tts_engine.serving.app import ServerConfig
from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint
from qwen3_tts_engine.worker.loading import load, resolve_compute_dtype
from qwen3_tts_engine.worker.scheduler import Scheduler

TEXTS = [
    "Streaming speech, four frames at a time.",
    "Every caller hears the first words quickly.",
    "One loaded model speaks on many calls at once.",
    "The batch grows and shrinks between two steps.",
    "Short answers end early, long ones go on.",
    "Nobody waits for a whole utterance any more.",
    "Each stream keeps its own voice and its own seed.",
    "The vocoder remembers every stream separately.",
]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 4), "p95": round(_pct(values, 0.95), 4),
            "n": len(values)}  # fmt: skip


def _requests(n: int, frames: int, voice: str | None, repeat: int) -> list[SpeechRequest]:
    return [SpeechRequest(input=TEXTS[k % len(TEXTS)], voice=voice, language="english",
                          seed=repeat * 100 + k, max_new_tokens=frames) for k in range(n)]  # fmt: skip


def _level(model, reqs: list[SpeechRequest], *, batch: int, decode: bool) -> dict:
    """Run `reqs` (all admitted at t=0) through one scheduler of `batch` rows."""

    scheduler = Scheduler(model, max_batch=batch)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for k, req in enumerate(reqs):
        scheduler.add(str(k), req, decode=decode)
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    frames: dict[str, int] = {}
    codes: dict[str, list] = {}
    audio: dict[str, list] = {}  # decoded chunks: the first audible sample
    while len(end) < len(reqs):
        for ev in scheduler.step():
            now = time.perf_counter() - t0
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "chunk":
                first.setdefault(ev.stream.id, now)
                frames[ev.stream.id] = frames.get(ev.stream.id, 0) + ev.chunk.frames
                if ev.chunk.codes is not None:
                    codes.setdefault(ev.stream.id, []).append(ev.chunk.codes)
                if decode and ev.chunk.audio is not None:
                    audio.setdefault(ev.stream.id, []).append(ev.chunk.audio)
            else:
                end[ev.stream.id] = now
    wall = max(end.values())
    return {
        "first": list(first.values()),
        "audible": [first[k] + leading_silence_s(np.concatenate(v).reshape(-1)) for k, v in audio.items()],
        "rtf": [end[k] / (frames[k] / FRAME_RATE) for k in end],
        "frames_per_s": sum(frames.values()) / wall,
        "step_s": list(scheduler.step_s), "codes_s": list(scheduler.codes_s),
        "peak_bytes": mx.get_peak_memory() - base,
        "codes": {k: np.concatenate(v) for k, v in codes.items()},
    }  # fmt: skip


def _flips(batched: list[dict], alone: list[dict]) -> dict:
    """Streams whose codes differ between a batched run and the one-by-one run of the same
    seeded requests, and the first frame where each differs."""
    differ, first = 0, []
    n = 0
    for b, a in zip(batched, alone, strict=True):
        for k, codes in b["codes"].items():
            n += 1
            ref = a["codes"][k]
            m = min(len(codes), len(ref))
            rows = np.nonzero((codes[:m] != ref[:m]).any(axis=1))[0]
            if len(codes) != len(ref) or rows.size:
                differ += 1
                first.append(int(rows[0]) if rows.size else m)
    return {"streams": n, "streams_with_other_codes": differ, "first_different_frame": first}


def _collect(runs: list[dict]) -> dict:
    out = {
        "first_audio_s": _summary([x for r in runs for x in r["first"]]),
        "rtf_per_stream": _summary([x for r in runs for x in r["rtf"]]),
        "frames_per_s": round(statistics.median(r["frames_per_s"] for r in runs), 3),
    }
    audible = [x for r in runs for x in r.get("audible", [])]
    if audible:  # none on the codes paths: no audio
        out["first_audible_s"] = _summary(audible)
    if "peak_bytes" in runs[0]:
        out["mlx_peak_bytes"] = max(r["peak_bytes"] for r in runs)
    steps = [x for r in runs for x in r.get("step_s", [])]
    if steps:
        codes = sum(x for r in runs for x in r["codes_s"])
        out["step_s"] = _summary(steps)
        out["vocoder_share"] = round(1 - codes / sum(steps), 4)  # of the scheduler's step time
    return out


def _in_process(model_path: str, levels: list[int], frames: int, repeats: int,
                compute_dtype: str | None, codes_only: bool = False) -> dict:  # fmt: skip

    model, _ = load(resolve(model_path), progress=False, compute_dtype=compute_dtype)
    voice = (
        sorted(model.config.talker_config.spk_id or {})[0]
        if model.config.talker_config.spk_id
        else None
    )
    _level(model, _requests(1, 4, voice, 99), batch=1, decode=not codes_only)  # warm-up
    paths: dict = (
        {"codes": {}, "codes_unbatched": {}}
        if codes_only
        else {"codes": {}, "codes_unbatched": {}, "full": {}}
    )
    raw: dict = {}
    # round-robin: each repeat runs every level and path once, so a machine that slows down or
    # speeds up during the run weighs on all levels alike (the ratios compare them)
    for r in range(repeats):
        print(f"  in process, repeat {r + 1} of {repeats}", file=sys.stderr, flush=True)
        for n in levels:
            for path, batch, decode in (
                ("codes", n, False),
                ("codes_unbatched", 1, False),
                ("full", n, True),
            ):
                if (path == "codes_unbatched" and n == 1) or path not in paths:
                    continue
                # a smaller level runs more often, so that every level's p95 is taken over as
                # many first-audio times as the largest level's (p95 of 5 is their maximum)
                for extra in range(1 if path == "codes_unbatched" else -(-max(levels) // n)):
                    reqs = _requests(n, frames, voice, r + repeats * extra)
                    run = _level(model, reqs, batch=batch, decode=decode)
                    raw.setdefault((path, n), []).append({**run, "extra": extra})
    for n in levels:
        raw["codes_unbatched", n] = raw["codes_unbatched", n] if n > 1 else raw["codes", n]
        for path in paths:
            paths[path][str(n)] = _collect(raw[path, n])
        if n > 1:
            paths["codes"][str(n)]["determinism"] = _flips(
                [run for run in raw["codes", n] if run["extra"] == 0], raw["codes_unbatched", n]
            )
    if codes_only:
        return paths
    one = paths["full"][str(levels[0])].get("mlx_peak_bytes")
    for n in levels[1:]:
        peak = paths["full"][str(n)].get("mlx_peak_bytes")
        if one is not None and peak is not None:
            paths["full"][str(n)]["mlx_bytes_per_extra_stream"] = (peak - one) // (n - levels[0])
    return paths


async def _http_stream(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> tuple:
    """First chunk, end, seconds of audio, first audible sample (all from `t0`)."""
    first = None
    pcm = bytearray()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for data in r.aiter_raw():
            first = first if first is not None else time.perf_counter() - t0
            pcm += data
    audible = first + leading_silence_s(bytes(pcm[: len(pcm) // 2 * 2]), SAMPLE_RATE)
    return first, time.perf_counter() - t0, len(pcm) // 2 / SAMPLE_RATE, audible


async def _http(model_path: str, levels: list[int], frames: int, repeats: int,
                compute_dtype: str | None) -> tuple[dict, str | None]:  # fmt: skip
    # No frame budget: every level runs all its streams together (the admission would hold back
    # the streams a slow machine cannot keep in real time); the sizing it would use is reported.
    server = build_server(EngineConfig(model_path, max_batch=max(levels), compute_dtype=compute_dtype,
                                       server=ServerConfig(port=0), frame_budget_s=None))  # fmt: skip
    await server.start()
    server.engine.active.steps.max_age_s = None  # the sizing reads every level's steps, however old
    url = f"http://127.0.0.1:{server.port}/v1/audio/speech"
    voice = (server.engine.active.info["voices"] or [None])[0]
    runs: dict[int, list] = {n: [] for n in levels}
    steps: dict[int, dict] = {}
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for r in range(repeats):  # round-robin over the levels, as in process
                print(f"  HTTP, repeat {r + 1} of {repeats}", file=sys.stderr, flush=True)
                for n in levels:
                    for extra in range(-(-max(levels) // n)):  # as many streams per level
                        t0 = time.perf_counter()
                        results = await asyncio.gather(*(
                            _http_stream(client, url, {**req.to_dict(), "stream": True,
                                                       "response_format": "pcm"}, t0)
                            for req in _requests(n, frames, voice, r + repeats * extra)
                        ))  # fmt: skip
                        wall = max(end for _, end, _, _ in results)
                        runs[n].append({"first": [f for f, _, _, _ in results],
                                        "audible": [a for _, _, _, a in results],
                                        "rtf": [end / secs for _, end, secs, _ in results],
                                        "frames_per_s": sum(secs for _, _, secs, _ in results) * FRAME_RATE / wall})  # fmt: skip
                    steps[n] = {k: server.engine.active.batching.get(k)  # the server's recent steps
                                for k in ("step_s_p50", "step_s_p95", "batch_occupancy")}  # fmt: skip
        compute = server.engine.active.info.get("compute_dtype")  # as the worker loaded it
        sizing = realtime_slots(server.engine.active.steps, max(levels))
    finally:
        await server.stop()
    return (
        {str(n): {**_collect(runs[n]), "server_step_s": steps[n]} for n in levels},
        compute,
        sizing,
    )


def realtime_slots(steps: StepModel, max_batch: int) -> dict:
    """Streams one engine keeps in real time (docs/fleet.md: sizing a fleet): the most streams
    whose step, as the server measured its steps, stays within the 80 ms a frame plays for."""
    return {"frame_budget_ms": round(FRAME_S * 1000, 3), "slots": steps.slots(FRAME_S, max_batch),
            "step_s": {str(n): round(p, 5) for n, p in steps.curve(max_batch).items()},
            "measured_step_s": {str(n): round(v, 5) for n, v in steps.measured().items()}}  # fmt: skip


def _ratios(path: dict) -> dict:
    one = path.get("1")
    if not one:
        return {}
    return {n: {"first_audio_p95_ratio": round(v["first_audio_s"]["p95"] / one["first_audio_s"]["p95"], 3),
                "frames_per_s_ratio": round(v["frames_per_s"] / one["frames_per_s"], 3)}
            for n, v in path.items()}  # fmt: skip


def run_concurrency_bench(args) -> int:

    model = args.model
    if args.real_size and model:
        print(
            "qwen3-tts: error: --real-size and --model name two models; give one", file=sys.stderr
        )
        return 2
    if args.real_size:  # the real 0.6B architecture, random weights (written once, ~2.5 GB)
        model = str(real_size_dir())
        if not (Path(model) / "speech_tokenizer" / "config.json").is_file():
            print(f"writing the real-size checkpoint to {model} ...", file=sys.stderr, flush=True)
            write_real_size_checkpoint(Path(model))
    elif not model:
        model = str(cache_root() / "tiny" / "custom_voice-8layers-seed0")
        if not (Path(model) / "config.json").is_file():
            write_tiny_checkpoint(model, variant="custom_voice", seed=0, talker_layers=8)
    levels = sorted(set(args.streams))
    compute_dtype = compute_dtype_option(args.compute_dtype)
    report: dict = {"model": model, "tiny_checkpoint": not (args.model or args.real_size), "streams": levels,
                    "frames_per_stream": args.frames, "repeats": args.repeats,
                    "compute_dtype": resolve_compute_dtype(compute_dtype) or "weights"}  # fmt: skip
    print(f"benchmarking concurrency on {model} ...", file=sys.stderr, flush=True)
    report["paths"] = _in_process(model, levels, args.frames, args.repeats, compute_dtype,
                                  codes_only=args.codes_only)  # fmt: skip
    if not (args.no_http or args.codes_only):
        report["paths"]["http"], compute, sizing = asyncio.run(_http(model, levels, args.frames, args.repeats,
                                                                      compute_dtype))  # fmt: skip
        report["server_compute_dtype"] = compute or "weights"
        report["realtime_slots"] = sizing
    report["ratios"] = {path: _ratios(v) for path, v in report["paths"].items()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
