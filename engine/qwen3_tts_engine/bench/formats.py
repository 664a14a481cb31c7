"""`qwen3-tts bench formats`: what each OpenAI response format costs over PCM.

Per format: time to the first response byte of a streamed request (`stream_format: "audio"`;
WAV comes whole) and its ratio to `pcm`'s in the same run; the first audible sample (the first
byte + the leading silence of the response's audio as ffmpeg decodes it, encoder delay included:
`audio.leading_silence_s`, as Coval's TTS benchmark counts it); the encoder's cost per 320 ms chunk
on that audio, and that cost as a share of the chunk's 320 ms (pcm costs nothing to encode).
JSON on stdout."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from qwen3_tts_engine.audio import AudioEncoder, encode_whole, leading_silence_s
from qwen3_tts_engine.config import EngineConfig, build_server
from qwen3_tts_engine.protocol import CHUNK_FRAMES, CONTENT_TYPES, FRAME_SAMPLES, STREAMED_FORMATS
from qwen3_tts_engine.serving.app import ServerConfig
from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog."
CHUNK_BYTES = CHUNK_FRAMES * FRAME_SAMPLES * 2


async def _first_byte(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, bytes]:
    t0, first, data = time.perf_counter(), None, bytearray()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for part in r.aiter_bytes():
            first = first if first is not None else time.perf_counter() - t0
            data += part
    return first, bytes(data)


def _leading_silence(data: bytes, fmt: str) -> float:
    """Seconds before the first audible sample of a response body, decoded as a player would."""
    if fmt == "pcm":
        return leading_silence_s(data[: len(data) // 2 * 2])
    import av  # ffmpeg's decoders, as the encoders (audio.AudioEncoder)

    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].sample_rate
        samples = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]  # mono
    return leading_silence_s(np.concatenate(samples), rate) if samples else 0.0


def _encode_costs(pcm: bytes, fmt: str) -> list[float]:
    """Seconds per 320 ms chunk (the last, shorter one and the encoder's flush excluded)."""
    if fmt == "wav":
        t0 = time.perf_counter()
        encode_whole(pcm, fmt)
        return [(time.perf_counter() - t0) * CHUNK_BYTES / max(1, len(pcm))]
    encoder, costs = AudioEncoder(fmt), []
    for i in range(0, len(pcm) - CHUNK_BYTES + 1, CHUNK_BYTES):
        t0 = time.perf_counter()
        encoder.encode(pcm[i : i + CHUNK_BYTES])
        costs.append(time.perf_counter() - t0)
    encoder.finish()
    return costs


async def _measure(model: str, frames: int, repeats: int) -> dict:
    server = build_server(EngineConfig(model, server=ServerConfig(port=0)))
    await server.start()
    url = f"http://127.0.0.1:{server.port}/v1/audio/speech"
    voice = (server.engine.active.info["voices"] or [None])[0]
    out: dict = {}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
            _, pcm = await _first_byte(client, url, {"input": TEXT, "voice": voice, "seed": 0,
                                                     "max_new_tokens": frames, "stream": True,
                                                     "response_format": "pcm"})  # fmt: skip
            for fmt in CONTENT_TYPES:
                print(f"  {fmt}", file=sys.stderr)
                firsts, audible = [], []
                for i in range(repeats):
                    body = {"input": TEXT, "voice": voice, "seed": i, "max_new_tokens": frames,
                            "response_format": fmt}  # fmt: skip
                    if fmt in STREAMED_FORMATS:
                        body["stream_format"] = "audio"
                    first, data = await _first_byte(client, url, body)
                    firsts.append(first)
                    audible.append(first + _leading_silence(data, fmt))
                costs = [c for _ in range(repeats) for c in _encode_costs(pcm, fmt)]
                out[fmt] = {"streamed": fmt in STREAMED_FORMATS,
                            "first_byte_s": statistics.median(firsts),
                            "first_audible_s": statistics.median(audible),
                            "encode_s_per_chunk": statistics.median(costs)}  # fmt: skip
    finally:
        await server.stop()
    base, chunk_s = out["pcm"], CHUNK_FRAMES * FRAME_SAMPLES / 24000
    for v in out.values():
        v["first_byte_ratio_to_pcm"] = v["first_byte_s"] / base["first_byte_s"]
        # pcm costs nothing to encode, so the encoders are compared with the audio's own pace
        v["encode_share_of_chunk_audio"] = v["encode_s_per_chunk"] / chunk_s
    return out


def run_formats_bench(args: argparse.Namespace) -> int:
    model = args.model or str(default_tiny_checkpoint())
    print(f"benchmarking response formats on {model} ...", file=sys.stderr)
    formats = asyncio.run(_measure(model, args.frames, args.repeats))
    report = {"model": model, "frames_per_request": args.frames, "repeats": args.repeats,
              "chunk_s": CHUNK_FRAMES * FRAME_SAMPLES / 24000, "formats": formats}  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
