"""`qwen3-tts demo`: the engine end to end with no network — server, streamed HTTP, a WAV file.

Starts an engine server on 127.0.0.1 (a tiny random checkpoint unless --model is given),
streams one text over the HTTP protocol, writes the audio and prints what happened.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from qwen3_tts_engine.audio import write_wav
from qwen3_tts_engine.config import EngineConfig, build_server
from qwen3_tts_engine.protocol import HEADER_VARIANT, SAMPLE_RATE
from qwen3_tts_engine.serving.app import ServerConfig
from qwen3_tts_engine.tiny_checkpoints import TINY_WARNING, default_tiny_checkpoint


async def _demo(model: str, text: str, out: Path, max_new_tokens: int | None) -> dict:
    server = build_server(EngineConfig(model, server=ServerConfig(port=0)))
    t0 = time.perf_counter()
    print(f"starting the engine server ({model}) ...", file=sys.stderr)
    await server.start()
    start_s = time.perf_counter() - t0
    try:
        url = f"http://127.0.0.1:{server.port}/v1/audio/speech"
        payload = {"input": text, "response_format": "pcm", "stream": True, "language": "en",
                   "seed": 0, "max_new_tokens": max_new_tokens}  # fmt: skip
        pcm = bytearray()
        sizes: list[int] = []
        t1 = time.perf_counter()
        first = None
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
            async with client.stream("POST", url, json=payload) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"engine answered {r.status_code}: {r.text}")
                variant = r.headers.get(HEADER_VARIANT)
                async for data in r.aiter_raw():
                    first = first if first is not None else time.perf_counter() - t1
                    pcm += data
                    sizes.append(len(data) // 2)
                    print(f"  chunk {len(sizes)}: {len(data) // 2} samples", file=sys.stderr)
        total = time.perf_counter() - t1
    finally:
        await server.stop()

    write_wav(out, bytes(pcm))
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    return {
        "model": model, "variant": variant, "server_start_s": round(start_s, 3),
        "first_audio_s": round(first or 0.0, 4), "total_s": round(total, 3),
        "audio_s": round(audio_s, 3), "rtf": round(total / audio_s, 3) if audio_s else None,
        "http_reads": len(sizes), "samples": len(pcm) // 2, "out": str(out),
    }  # fmt: skip


def run_demo(args) -> int:

    model, max_new_tokens = args.model, args.max_new_tokens
    if not model:
        print(TINY_WARNING, file=sys.stderr)
        model = str(default_tiny_checkpoint())
        # Random weights never say "stop": bound the noise to 2 s of audio by default.
        max_new_tokens = max_new_tokens or 25
    report = asyncio.run(_demo(model, args.text, Path(args.out), max_new_tokens))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['audio_s']}s of audio ({report['variant']}) in {report['total_s']}s; "
              f"first audio after {report['first_audio_s']}s -> {report['out']}")  # fmt: skip
    return 0
