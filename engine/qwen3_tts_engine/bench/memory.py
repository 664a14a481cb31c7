"""Per-rung process memory of an engine worker on the real Qwen3-TTS 0.6B architecture.

Random weights at the real sizes (talker, speech tokenizer); each rung is quantized into the
cache in a child process, then loaded by a fresh engine worker: memory after load
and after one synthesis. `qwen3-tts bench --real-size-memory` or `python -m` this module (JSON).
`qwen3-tts bench memory` (`run_batch_memory_bench`): the peak of a full batch, `--max-batch`
streams speaking 4-frame chunks together, per stream and extrapolated to the frame cap.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import queue as queue_module
import sys
import time
from pathlib import Path

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten
from mlx_audio.tts.models.qwen3_tts import Model, ModelConfig
from mlx_audio.tts.models.qwen3_tts.config import (
    Qwen3TTSTokenizerConfig,
    Qwen3TTSTokenizerDecoderConfig,
    Qwen3TTSTokenizerEncoderConfig,
)
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import (
    Qwen3TTSSpeechTokenizer,
    Qwen3TTSSpeechTokenizerDecoder,
)

from qwen3_tts_engine.dispatch.handler import Handler, Result
from qwen3_tts_engine.fast_blas import environment_for_child
from qwen3_tts_engine.models.checkpoints import cache_root
from qwen3_tts_engine.models.stream_memory import kv_positions
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import CHUNK_FRAMES, DEFAULT_MAX_BATCH, Limits, SpeechRequest
from qwen3_tts_engine.tiny_checkpoints import builder as tiny
from qwen3_tts_engine.worker.loading import load, prepare, release_freed_memory
from qwen3_tts_engine.worker.measure import model_bytes, stream_layout
from qwen3_tts_engine.worker.scheduler import Scheduler

DEFAULT_RUNGS = ("bf16", "8bit", "4bit", "4bit-emb8", "4bit-emb4", "4bit-emb4-voc16")
TEXT = "Memory, measured after one sentence."
# One short chunk: the vocoder runs once. No warm-up besides it: quantized matmuls run ~7x slower
# than bf16 ones on mlx-cpu, so a real-size frame costs about a minute on 2 cores.
FRAMES = 2
MB = 10**6
# Keys of the talker config that set its size (the rest: token ids, languages, speakers).
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "text_hidden_size", "rope_scaling")  # fmt: skip


def real_size_dir() -> Path:

    return cache_root() / "real-size" / "custom_voice-0b6-seed0"


def real_size_config() -> dict:
    """The root config.json of the real-size checkpoint: the tiny checkpoint's ids and speakers
    with the real 0.6B talker and code-predictor sizes."""
    config = tiny.tiny_config("custom_voice")
    real = dataclasses.asdict(ModelConfig.from_dict(
        {"tts_model_type": "custom_voice", "tts_model_size": "0b6"}).talker_config)  # fmt: skip
    talker = config["talker_config"]
    talker.update({k: real[k] for k in _SIZE_KEYS})
    talker["code_predictor_config"].update(
        {k: real["code_predictor_config"][k] for k in (*_SIZE_KEYS[:6], "layer_types")}
    )
    return config


def real_size_tensors() -> tuple[dict, dict, int]:
    """The real-size checkpoint's tensors as its safetensors headers would list them, without
    writing or computing a weight (mlx arrays are lazy: building the modules allocates nothing
    until an array is evaluated): (the root tensors, bf16; the speech tokenizer's decoder,
    float32, named `decoder.*`; the talker's layer count), for `models.memory_plan`. The speech
    tokenizer's encoder is left out: CustomVoice models drop it at load."""
    config = real_size_config()
    model = Model(ModelConfig.from_dict(config))
    root = {k: (tuple(v.shape), "BF16") for k, v in tree_flatten(model.parameters())}
    decoder = Qwen3TTSSpeechTokenizerDecoder(Qwen3TTSTokenizerDecoderConfig())
    vocoder = {
        f"decoder.{k}": (tuple(v.shape), "F32") for k, v in tree_flatten(decoder.parameters())
    }
    return root, vocoder, config["talker_config"]["num_hidden_layers"]


def write_real_size_checkpoint(out: Path, seed: int = 0) -> Path:
    """A CustomVoice checkpoint with the real 0.6B sizes and random weights (bf16 talker, float32
    speech tokenizer, ~2.5 GB): the tiny checkpoint's tokenizer, ids and speakers, scaled up."""
    config = real_size_config()
    out.mkdir(parents=True, exist_ok=True)
    model = Model(ModelConfig.from_dict(config))
    mx.random.seed(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim == 1:
            w = mx.ones(value.shape)
        else:
            w = mx.random.normal(value.shape) * (
                1.0 if "embedding" in name else value.shape[-1] ** -0.5
            )
        weights[name] = w.astype(mx.bfloat16)
        mx.eval(weights[name])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights, model
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tiny.write_tokenizer(out)
    st_config = tiny._speech_tokenizer_config()
    st_config["decoder_config"] = dataclasses.asdict(Qwen3TTSTokenizerDecoderConfig())
    st_config["encoder_config"] = {**st_config["encoder_config"],
                                   **dataclasses.asdict(Qwen3TTSTokenizerEncoderConfig())}  # fmt: skip
    st = Qwen3TTSSpeechTokenizer(Qwen3TTSTokenizerConfig(
        encoder_config=Qwen3TTSTokenizerEncoderConfig(), decoder_config=Qwen3TTSTokenizerDecoderConfig()))  # fmt: skip
    _, hf = tiny._speech_tokenizer_weights(st, seed)
    (out / "speech_tokenizer").mkdir(exist_ok=True)
    mx.save_safetensors(str(out / "speech_tokenizer" / "model.safetensors"),
                        {k: hf[k] for k in sorted(hf)}, metadata={"format": "pt"})  # fmt: skip
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps(st_config, indent=2))
    return out


def _child(target, *args):
    """Run `target(*args)` in a spawned process (its memory is returned to the system after)."""
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{target.__name__}{args} failed (exit code {p.exitcode})")


def _prepare(model: str, rung: str) -> None:

    prepare(resolve(model, rung), progress=False)


def _mb(v) -> float | None:
    return round(v / MB, 1) if v is not None else None


def _hwm(pid: int | None) -> int | None:
    """The process's RSS high-water mark (Linux: VmHWM), None where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm(pid: int | None) -> bool:
    """Reset the process's RSS high-water mark to its RSS now (Linux >= 4.0: clear_refs 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


async def measure_rung(
    model: str, rung: str, frames: int = FRAMES, compute_dtype: str | None = None
) -> dict:
    """One fresh engine worker for `rung` (its talker computing in `compute_dtype`, None: the
    weights' dtype): memory after load and after one synthesis. The peaks: RSS sampled every 50
    ms while it speaks, and the kernel's high-water mark of the RSS after load (the load's
    peak) and, reset then, after the utterance (the peak while it speaks; Linux)."""
    h = Handler(model, rung, warmup=False, compute_dtype=compute_dtype)
    info = await h.start()
    hwm_load = _hwm(h.pid)
    reset = _reset_hwm(h.pid)
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, (await h.memory()).get("rss_bytes", 0))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    try:
        result = Result()
        voice = (info["voices"] or [None])[0]
        t0 = time.perf_counter()
        n = 0
        async for chunk in h.synthesize(SpeechRequest(input=TEXT, voice=voice, seed=0, language="english",
                                                      max_new_tokens=frames), result=result):  # fmt: skip
            n += chunk.frames
        synth_s = time.perf_counter() - t0
        sampler.cancel()
        await asyncio.sleep(0.5)  # the worker releases freed memory once the stream is done
        after = await h.memory()
        hwm = _hwm(h.pid)
    finally:
        sampler.cancel()
        await h.stop(drain=False)
    fp = info.get("footprint", {})
    loaded, warm = fp.get("loaded", {}), info.get("memory", {})
    weights = (
        fp.get("talker_bytes", 0)
        + fp.get("speech_tokenizer_bytes", 0)
        + fp.get("speaker_encoder_bytes", 0)
    )
    return {
        "rung": rung, "compute_dtype": info.get("compute_dtype"), "quantized_modules": len(info.get("quantized_modules", {})),
        "load_s": info.get("load_s"), "synthesis_s": synth_s, "frames": n,
        "mb": {
            "talker_weights": _mb(fp.get("talker_bytes")),
            "speech_tokenizer": _mb(fp.get("speech_tokenizer_bytes")),
            "speaker_encoder": _mb(fp.get("speaker_encoder_bytes")),
            "rss_after_load": _mb(loaded.get("rss_bytes")),
            "rss_before_synthesis": _mb(warm.get("rss_bytes")),
            "rss_peak_during_synthesis": _mb(peak),
            "rss_hwm_after_load": _mb(hwm_load),  # the largest RSS while loading
            "rss_hwm_while_speaking": _mb(hwm) if reset else None,  # ... while speaking
            "rss_after_synthesis": _mb(after.get("rss_bytes")),
            "runtime": _mb(after.get("rss_bytes", 0) - weights),  # interpreter, libraries, caches
            "mlx_active_after_synthesis": _mb(after.get("mlx_active_bytes")),
            "mlx_cache_after_synthesis": _mb(after.get("mlx_cache_bytes")),
            "mlx_peak": _mb(after.get("mlx_peak_bytes")),
            "kv_per_frame": round(fp.get("kv_bytes_per_frame", 0) / MB, 4),
        },
    }  # fmt: skip


def _real_size_checkpoint(progress) -> str:
    """The real-size random checkpoint's directory, written (in a child process) the first time."""
    path = real_size_dir()
    if not (path / "speech_tokenizer" / "config.json").is_file():
        progress(f"writing the real-size checkpoint to {path} ...")
        _child(write_real_size_checkpoint, path)
    return str(path)


def run_memory_bench(rungs=DEFAULT_RUNGS, model: str | None = None, progress=print,
                     compute_dtype: str | None = None) -> dict:  # fmt: skip
    model = model or _real_size_checkpoint(progress)
    out = {"model": model, "text": TEXT, "frames": FRAMES, "rungs": {}}
    for rung in rungs:
        progress(f"  {rung}: quantizing into the cache (child process)")
        _child(_prepare, model, rung)
        progress(f"  {rung}: fresh worker")
        out["rungs"][rung] = asyncio.run(measure_rung(model, rung, compute_dtype=compute_dtype))
        progress(f"  {rung}: {out['rungs'][rung]['mb']}")
    bf16 = out["rungs"].get("bf16", {}).get("mb", {})
    if bf16:
        out["ratio_to_bf16"] = {
            key: {r: round(v["mb"][key] / bf16[key], 3) for r, v in out["rungs"].items()}
            for key in ("rss_after_load", "rss_peak_during_synthesis", "rss_after_synthesis",
                        "rss_hwm_after_load", "rss_hwm_while_speaking")
            if all(v["mb"][key] for v in out["rungs"].values())
        }  # fmt: skip
    return out


BATCH_FRAMES = 8  # per stream in `bench memory`: two 4-frame chunks (CPU: ~13 s of vocoder each)
BATCH_TEXTS = [
    "Every caller in the batch speaks at once.",
    "Four frames at a time, for each of them.",
    "The cache grows by one position a frame.",
    "Memory is counted before a stream starts.",
    "A full batch holds the most it ever will.",
    "Nobody waits unless the memory runs out.",
    "The vocoder decodes every stream's chunk.",
    "The peak is read from the kernel and mlx.",
]


def _rss() -> int:
    return psutil.Process().memory_info().rss


def measure_batch(model: str, rung: str = "bf16", streams: int = DEFAULT_MAX_BATCH,
                  frames: int = BATCH_FRAMES, compute_dtype: str | None = None,
                  progress=print) -> dict:  # fmt: skip
    """`streams` streams of `frames` frames each (4-frame chunks) through one scheduler, as a
    worker with `--max-batch streams` runs them (its loader, its `Scheduler`), in this process:
    the peak RSS (the kernel's high-water mark, reset after load) and mlx's peak (its allocator's
    largest active bytes, `mx.get_peak_memory`; on the CPU backend the same counter Metal
    keeps), over the memory after load, per stream; the talker's KV cache after every step. Each
    stream's memory at the frame cap is extrapolated from the measured peak with the measured
    bytes per cache position (the cache's own arrays), not run: a 4096-frame batch at real size
    takes hours on a CPU."""
    pid = os.getpid()
    m, details = load(resolve(model, rung), progress=False, compute_dtype=compute_dtype)
    release_freed_memory()
    rss_load, mlx_load = _rss(), mx.get_active_memory()
    layout = stream_layout(m)
    weights = model_bytes(m)
    speakers = sorted(m.config.talker_config.spk_id or {})
    voice = speakers[0] if speakers else None
    scheduler = Scheduler(m, max_batch=streams)
    mx.reset_peak_memory()
    reset = _reset_hwm(pid)
    for k in range(streams):
        scheduler.add(str(k), SpeechRequest(input=BATCH_TEXTS[k % len(BATCH_TEXTS)], voice=voice,
                                            language="english", seed=k, max_new_tokens=frames))  # fmt: skip
    made: dict[str, int] = {}
    chunks = ended = 0
    steps = []
    rss_peak_sampled = 0
    t0 = time.perf_counter()
    while ended < streams:
        ts = time.perf_counter()
        rows_before = len(scheduler.rows)
        events = scheduler.step()
        for ev in events:
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "chunk":
                chunks += 1
                made[ev.stream.id] = made.get(ev.stream.id, 0) + ev.chunk.frames
            else:
                ended += 1
        cache = scheduler.cache
        rows = len(scheduler.rows)
        allocated = cache[0].keys.shape[2] if cache and cache[0].keys is not None else 0
        rss = _rss()
        rss_peak_sampled = max(rss_peak_sampled, rss)
        steps.append({"step": len(steps) + 1, "rows": max(rows, rows_before), "cache_rows": rows,
                      "cache_positions": allocated, "kv_bytes": scheduler.kv_bytes(),
                      "vocoder_state_bytes": sum(s.vocoder.state_bytes() for s in scheduler.streams.values()
                                                 if s.vocoder is not None),
                      "chunks": sum(ev.kind == "chunk" for ev in events),
                      "mlx_active_mb": _mb(mx.get_active_memory()), "rss_mb": _mb(rss),
                      "seconds": round(time.perf_counter() - ts, 3)})  # fmt: skip
        progress(f"  step {len(steps)}: {steps[-1]['rows']} streams, {chunks} chunks so far, "
                 f"rss {_mb(rss)} MB, {steps[-1]['seconds']:.1f} s")  # fmt: skip
    wall = time.perf_counter() - t0
    rss_peak = _hwm(pid) if reset else None
    rss_peak = max(rss_peak or 0, rss_peak_sampled)
    mlx_peak = mx.get_peak_memory()
    # bytes per cache position per row, from the cache's arrays (the per-frame slope)
    per_position = max((s["kv_bytes"] // (s["cache_rows"] * s["cache_positions"])
                        for s in steps if s["cache_rows"] and s["cache_positions"]), default=0)  # fmt: skip
    longest = max(made.values(), default=0)
    speaking = rss_peak - rss_load
    # the measured peak, each stream's cache row grown from what this run allocated to the cap's
    cap = Limits.max_new_tokens
    growth = (kv_positions(cap) - kv_positions(longest)) * per_position
    kv_parts = layout.batch_bytes([longest] * streams)  # talker rows, predictor, vocoder window
    weight_bytes = sum(weights.values())
    return {
        "rung": rung, "compute_dtype": details.get("compute_dtype"), "streams": streams,
        "frames_per_stream": frames, "frames_made": made, "chunks": chunks,
        "wall_s": round(wall, 1), "steps": steps,
        "layout_bytes": layout.as_dict(),
        "kv_bytes_per_position_measured": per_position,
        "mb": {
            "weights": _mb(weight_bytes), **{k.removesuffix("_bytes"): _mb(v) for k, v in weights.items()},
            "rss_after_load": _mb(rss_load), "rss_peak": _mb(rss_peak),
            "rss_peak_over_weights": round(rss_peak / weight_bytes, 3),
            "speaking": _mb(speaking), "speaking_per_stream": _mb(speaking / streams),
            "mlx_after_load": _mb(mlx_load), "mlx_peak": _mb(mlx_peak),
            "mlx_speaking": _mb(mlx_peak - mlx_load),
            "mlx_speaking_per_stream": _mb((mlx_peak - mlx_load) / streams),
            "kv_parts_per_stream": _mb(kv_parts / streams),
            # what the peak holds per stream besides the KV parts: the vocoder's chunk transients,
            # activations, allocator slack (RSS)
            "transient_per_stream": _mb((speaking - kv_parts) / streams),
        },
        "at_cap": {
            "frames": cap, "cache_positions": kv_positions(cap),
            "extrapolated": "measured peak + (cache positions at the cap - this run's) x the "
                            "measured bytes per position, per stream",
            "speaking_per_stream_mb": _mb(speaking / streams + growth),
            "speaking_mb": _mb(speaking + streams * growth),
            "rss_peak_mb": _mb(rss_peak + streams * growth),
        },
    }  # fmt: skip


def run_batch_memory_bench(rungs=("bf16",), model: str | None = None, streams: int = DEFAULT_MAX_BATCH,
                           frames: int = BATCH_FRAMES, compute_dtype: str | None = None,
                           progress=print) -> dict:  # fmt: skip
    """`measure_batch` per rung, each in a fresh process (the real-size checkpoint by default,
    written once)."""
    if frames % CHUNK_FRAMES:
        raise ValueError(f"--frames must be a multiple of {CHUNK_FRAMES} (whole chunks)")
    model = model or _real_size_checkpoint(progress)
    out: dict = {"model": model, "streams": streams, "frames_per_stream": frames, "rungs": {}}
    for rung in rungs:
        progress(f"  {rung}: quantizing into the cache (child process)")
        _child(_prepare, model, rung)
        progress(f"  {rung}: {streams} streams x {frames} frames in a fresh process")
        out["rungs"][rung] = _in_child(model, rung, streams, frames, compute_dtype)
        progress(f"  {rung}: {out['rungs'][rung]['mb']}")
    return out


def _batch_target(queue, *args) -> None:
    queue.put(measure_batch(*args, progress=lambda m: print(m, file=sys.stderr, flush=True)))


def _in_child(*args):
    """`measure_batch(*args)` in a spawned process (OpenBLAS preloaded: this module imports mlx
    before a spawned child could load it, `fast_blas.py`); its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_batch_target, args=(queue, *args))
    saved = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = environment_for_child().get("LD_PRELOAD", "")
    try:
        p.start()
    finally:
        if saved is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = saved
    while True:  # its result, or its failure (a child that died puts nothing)
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not p.is_alive():
                raise RuntimeError(f"measure_batch{args} failed (exit code {p.exitcode})") from None
    p.join()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variants", default=",".join(DEFAULT_RUNGS))
    p.add_argument(
        "--model", help="a full-precision checkpoint (default: real-size random weights)"
    )
    p.add_argument(
        "--compute-dtype",
        choices=("weights", "float32"),
        default="weights",
        help="the talker's compute dtype (default: the weights' own)",
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    rungs = [v.strip() for v in args.variants.split(",") if v.strip()]
    report = run_memory_bench(rungs, args.model, progress=lambda m: print(m, file=sys.stderr, flush=True),
                              compute_dtype=None if args.compute_dtype == "weights" else args.compute_dtype)  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
