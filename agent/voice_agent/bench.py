"""`voice-agent bench`: what the pipeline adds to a turn, and TTS under LLM contention (JSON).

1. Over N spoken turns: voice-to-voice latency minus (VAD silence window + STT compute + LLM
   time to first token + TTS first-chunk compute) = the latency the glue adds (p50/p95).
2. TTS first-audio latency while the local LLM generates, divided by the same when idle.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from .demo import DEFAULT_QUESTION, load_turn_audio, run_turns
from .local_services import ensure_llm
from .settings import Settings

# Turn detection waits for Silero's min_silence_duration (LiveKit's default 0.55 s) of silence.
# The endpointing min_delay (0.5 s) counts from the same moment (the end of speech), so it
# overlaps with this window and with STT, and is not added again.
VAD_SILENCE_S = 0.55


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(xs: list[float]) -> dict:
    return {"p50": statistics.median(xs), "p95": _pct(xs, 0.95), "n": len(xs)} if xs else {}


async def _tts_first_audio(url: str, n: int, voice: str, i0: int = 0) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=600) as c:
        for i in range(n):
            body = {"input": "How can I help you today?", "voice": voice, "seed": i0 + i,
                    "max_new_tokens": 4, "stream": True, "response_format": "pcm"}  # fmt: skip
            t0 = time.perf_counter()
            first = None
            async with c.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
                r.raise_for_status()
                async for _ in r.aiter_raw():
                    first = first if first is not None else time.perf_counter() - t0
            out.append(first)
    return out


async def _llm_busy(llm_url: str, model: str, stop: asyncio.Event) -> int:
    """Keep the LLM generating (streamed completions, one after another) until `stop`."""
    n = 0
    async with httpx.AsyncClient(timeout=600) as c:
        while not stop.is_set():
            body = {"model": model, "stream": True, "max_tokens": 200, "temperature": 1.0,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
            async with c.stream("POST", f"{llm_url}/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    n += 1
                    if stop.is_set():
                        break
    return n


async def _bench(settings: Settings, turns: int, tts_requests: int) -> dict:
    from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig

    from .local_services import RANDOM_TTS, hub_model_available

    model, notes = settings.tts_model, []
    if not hub_model_available(model, settings.offline):
        from qwen3_tts_engine import default_tiny_checkpoint

        model, notes = str(default_tiny_checkpoint()), [RANDOM_TTS]
    engine = EngineServer(Engine(model, [Handler(model, settings.tts_variant)]), ServerConfig(port=0))
    await engine.start()
    handler = engine.engine.active
    tts_url = f"http://127.0.0.1:{engine.port}"
    llm = await asyncio.to_thread(ensure_llm, settings)
    notes += list(llm.notes)
    if llm.model:
        settings = replace(settings, llm_model=llm.model)
    if notes:  # random models: bound the replies
        settings = replace(settings, llm_max_tokens=min(settings.llm_max_tokens, 12),
                           llm_temperature=settings.llm_temperature or 1.0,
                           tts_max_new_tokens=settings.tts_max_new_tokens or 4)  # fmt: skip
    try:
        audio = load_turn_audio(None)
        rows, silent = [], 0
        for _ in range(turns):
            before = len(handler.history)
            (r,) = await run_turns(settings, [audio], tts_url=tts_url, llm_url=llm.url)
            silent += r.silent  # a random LLM can answer nothing (or only markup the TTS skips)
            syntheses = list(handler.history)[before:]
            first_chunk = syntheses[0]["chunk_compute_s"][0] if syntheses and syntheses[0]["chunk_compute_s"] else None
            if None in (r.voice_to_voice_s, r.stt_s, r.llm_ttft_s, first_chunk):
                continue
            parts = VAD_SILENCE_S + r.stt_s + r.llm_ttft_s + first_chunk
            rows.append({"voice_to_voice_s": r.voice_to_voice_s, "stt_s": r.stt_s,
                         "llm_ttft_s": r.llm_ttft_s, "tts_first_chunk_compute_s": first_chunk,
                         "added_s": r.voice_to_voice_s - parts})  # fmt: skip
        voice = (handler.info.get("voices") or [None])[0]
        idle = await _tts_first_audio(tts_url, tts_requests, voice)
        stop = asyncio.Event()
        busy_task = asyncio.create_task(_llm_busy(llm.url, settings.llm_model, stop))
        await asyncio.sleep(1.0)  # the LLM is generating
        busy = await _tts_first_audio(tts_url, tts_requests, voice, i0=100)
        stop.set()
        lines = await busy_task
    finally:
        llm.stop()
        await engine.stop()
    added = [r["added_s"] for r in rows]
    return {
        "notes": notes, "turns": rows, "silent_turns": silent, "vad_silence_window_s": VAD_SILENCE_S,
        "added_latency_s": _summary(added), "goal_added_p95_s": 0.060,
        "tts_first_audio_idle_s": _summary(idle), "tts_first_audio_llm_busy_s": _summary(busy),
        "llm_stream_lines_during_busy": lines,
        "contention_ratio": statistics.median(busy) / statistics.median(idle), "goal_ratio": 1.3,
    }  # fmt: skip


def run_bench(settings: Settings, turns: int, tts_requests: int, out: Path | None) -> int:
    print(f"voice-agent bench: {turns} turns of {DEFAULT_QUESTION!r} ...", file=sys.stderr)
    report = asyncio.run(_bench(settings, turns, tts_requests))
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text)
    return 0
