"""`qwen3-tts bench`: engine benchmarks as JSON (compare ratios within one run: shared machines).

Per variant: load time, worker memory, first-audio latency, per-chunk compute, real-time factor.
Overhead: first audio over HTTP through the server / first audio from mlx-audio's own
`generate()` in one process. Concurrency: p50/p95 first audio with 1, 2, 4 clients. Optionally the
weight bytes and a fresh worker's process memory of the real 0.6B architecture (random weights)
per variant (bench/memory.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_audio.tts.models.qwen3_tts import Model, ModelConfig
from mlx_audio.tts.utils import load_model

from qwen3_tts_engine.audio import leading_silence_s
from qwen3_tts_engine.bench.memory import run_memory_bench
from qwen3_tts_engine.config import EngineConfig, build_server
from qwen3_tts_engine.dispatch.handler import Handler, Result
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.checkpoints import cache_root
from qwen3_tts_engine.models.recipes import get_recipe
from qwen3_tts_engine.protocol import FRAME_SAMPLES, SAMPLE_RATE, SpeechRequest
from qwen3_tts_engine.serving.app import ServerConfig
from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint
from qwen3_tts_engine.worker.cpu_kernels import on_cpu, use_fast_cpu_kernels
from qwen3_tts_engine.worker.loading import apply_recipe

TEXT = "Streaming speech, four frames at a time, as fast as the machine allows."


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _summary(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "p95": _pct(values, 0.95), "n": len(values)}


async def _variant(model: str, variant: str, repeats: int, frames_cap: int) -> dict:
    h = Handler(model, variant)
    info = await h.start()
    first, chunk_compute, rtf = [], [], []
    try:
        for i in range(repeats):
            result = Result()
            t0 = time.perf_counter()
            frames = 0
            req = SpeechRequest(input=TEXT, voice=(info["voices"] or [None])[0], seed=i,
                                max_new_tokens=frames_cap, language="english")  # fmt: skip
            async for chunk in h.synthesize(req, result=result):
                chunk_compute.append(chunk.compute_s)
                frames += chunk.frames
            total = time.perf_counter() - t0
            first.append(result.first_audio_s)
            rtf.append(total / (frames * FRAME_SAMPLES / SAMPLE_RATE))
        memory = await h.memory()
    finally:
        await h.stop(drain=False)
    return {
        "variant": variant, "load_s": info["load_s"], "start_s": info["start_s"],
        "quantized_modules": len(info["quantized_modules"]), "worker_rss_bytes": memory.get("rss_bytes"),
        "mlx_active_bytes": memory.get("mlx_active_bytes"), "first_audio_s": _summary(first),
        "chunk_compute_s": _summary(chunk_compute), "rtf": _summary(rtf),
    }  # fmt: skip


def _direct_first_audio(model: str, repeats: int, frames: int, queue) -> None:
    """mlx-audio's own streaming generate() in this (spawned) process's main thread, on the
    engine's CPU kernels (the ratio against it is the serving's overhead, not the kernels')."""

    with contextlib.redirect_stdout(sys.stderr):  # mlx-audio prints while loading: keep stdout JSON
        m = load_model(Path(model))
    if on_cpu():
        use_fast_cpu_kernels(m.speech_tokenizer)
    voice = sorted(m.config.talker_config.spk_id or {})[0]
    out = []
    for i in range(repeats + 1):  # the first run warms up, as the handler's warm-up does
        mx.random.seed(i)
        t0 = time.perf_counter()
        gen = m.generate(text=TEXT, voice=voice, lang_code="english", stream=True,
                         streaming_interval=0.32, max_tokens=frames)  # fmt: skip
        next(gen)
        out.append(time.perf_counter() - t0)
        gen.close()
    queue.put(out[1:])


async def _http_first_audio(url: str, body: dict) -> tuple[float, float]:
    """Seconds to the first chunk, and to the first audible sample (the first chunk + the
    audio's leading silence, `audio.leading_silence_s`) of a streamed PCM response."""
    async with httpx.AsyncClient(timeout=600) as c:
        t0 = time.perf_counter()
        first = None
        pcm = bytearray()
        async with c.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for data in r.aiter_raw():
                first = first if first is not None else time.perf_counter() - t0
                pcm += data
    return first, first + leading_silence_s(bytes(pcm[: len(pcm) // 2 * 2]), SAMPLE_RATE)


async def _server_numbers(model: str, repeats: int, frames: int, clients_levels) -> dict:
    server = build_server(
        EngineConfig(model, server=ServerConfig(port=0), frame_budget_s=None)
    )  # all run
    await server.start()
    url = f"http://127.0.0.1:{server.port}/v1/audio/speech"
    voice = (server.engine.active.info["voices"] or [None])[0]
    try:

        def body(i):
            return {"input": TEXT, "voice": voice, "seed": i, "language": "en",
                    "max_new_tokens": frames, "stream": True, "response_format": "pcm"}  # fmt: skip

        single = [await _http_first_audio(url, body(i)) for i in range(repeats)]
        concurrency, audible = {}, {}
        for clients in clients_levels:
            firsts: list[tuple[float, float]] = []
            for r in range(max(1, repeats // clients)):
                firsts += await asyncio.gather(*(_http_first_audio(url, body(r * 10 + k))
                                                 for k in range(clients)))  # fmt: skip
            concurrency[str(clients)] = _summary([f for f, _ in firsts])
            audible[str(clients)] = _summary([a for _, a in firsts])
    finally:
        await server.stop()
    return {"http_first_audio_s": _summary([f for f, _ in single]),
            "http_first_audible_s": _summary([a for _, a in single]),
            "concurrency_first_audio_s": concurrency, "concurrency_first_audible_s": audible}  # fmt: skip


def real_size_weight_bytes(recipe_name: str) -> dict:
    """Weight memory of the real Qwen3-TTS 0.6B architecture (random weights, bf16 base)."""

    model = Model(
        ModelConfig.from_dict({"tts_model_type": "custom_voice", "tts_model_size": "0b6"})
    )
    model.set_dtype(mx.bfloat16)
    plan = apply_recipe(model, get_recipe(recipe_name))
    params = dict(tree_flatten(model.parameters()))
    mx.eval(params)
    return {"weight_bytes": sum(v.nbytes for v in params.values()),
            "quantized_modules": len(plan)}  # fmt: skip


def _real_size_worker(recipe: str, queue) -> None:
    queue.put(real_size_weight_bytes(recipe))


def _in_child(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def run_bench(args) -> int:

    if args.model:
        model = args.model
    else:
        # 8 talker layers so that talker-mlp-w4 (layers 2..N-5) has something to quantize.
        model = str(cache_root() / "tiny" / "custom_voice-8layers-seed0")
        if not (Path(model) / "config.json").is_file():
            write_tiny_checkpoint(model, variant="custom_voice", seed=0, talker_layers=8)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    report: dict = {"model": model, "tiny_checkpoint": not args.model, "text": TEXT,
                    "frames_per_request": args.frames, "repeats": args.repeats}  # fmt: skip
    print(f"benchmarking {model} ...", file=sys.stderr)

    report["variants"] = []
    for v in variants:
        print(f"  variant {v}", file=sys.stderr)
        report["variants"].append(asyncio.run(_variant(model, v, args.repeats, args.frames)))

    print("  direct mlx-audio vs HTTP server", file=sys.stderr)
    direct = _in_child(_direct_first_audio, model, args.repeats, args.frames)
    server = asyncio.run(_server_numbers(model, args.repeats, args.frames, args.clients))
    report["direct_first_audio_s"] = _summary(direct)
    report.update(server)
    report["overhead_ratio"] = server["http_first_audio_s"]["p50"] / statistics.median(direct)

    if args.real_size_memory:
        report["real_0_6b_weight_bytes"] = {}
        for v in variants:
            print(f"  real-size 0.6B weights, {v}", file=sys.stderr)
            report["real_0_6b_weight_bytes"][v] = _in_child(_real_size_worker, v)
        print("  real-size 0.6B process memory, one fresh worker per variant", file=sys.stderr)
        report["real_0_6b_process_memory"] = run_memory_bench(
            variants, progress=lambda m: print(m, file=sys.stderr, flush=True)
        )

    text = json.dumps(report, indent=2, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    logger.info("overhead ratio %.3f", report["overhead_ratio"])
    return 0
