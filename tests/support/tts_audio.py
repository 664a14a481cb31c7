"""Collecting a LiveKit TTS's audio in tests: text pushed word by word like an LLM, or one
`synthesize()` call; LiveKit's 10 ms end-of-segment marker frame is left out (see `pcm_frames`)."""

from __future__ import annotations

import asyncio

import numpy as np


def pcm(ev) -> np.ndarray | None:
    """The event's samples as int16, or None for LiveKit's end-of-segment marker: a final,
    all-zero 10 ms frame that its AudioEmitter adds when a segment is flushed with nothing
    pending (it depends on how fast audio arrived, not on what the engine made)."""
    data = np.frombuffer(bytes(ev.frame.data), dtype=np.int16)
    if ev.is_final and len(data) == ev.frame.sample_rate // 100 and not data.any():
        return None
    return data


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int16)


async def stream_text(tts, pieces: list[str], *, conn_options=None, on_audio=None):
    """Push `pieces` word by word into `tts.stream()`; (stream, int16 audio). `on_audio(samples)`
    is awaited after each audio frame with the samples received so far."""
    stream = tts.stream(**({"conn_options": conn_options} if conn_options else {}))
    audio: list[np.ndarray] = []

    async def feed():
        for sentence in pieces:
            for word in sentence.split(" "):
                stream.push_text(word + " ")
                await asyncio.sleep(0.005)
        stream.end_input()

    feeder = asyncio.create_task(feed())
    try:
        async for ev in stream:
            data = pcm(ev)
            if data is None:
                continue
            audio.append(data)
            if on_audio is not None:
                await on_audio(sum(len(a) for a in audio))
        await feeder
    finally:
        await stream.aclose()
        feeder.cancel()
    return stream, _joined(audio)


async def synthesize(tts, text: str, **kw) -> np.ndarray:
    """One `tts.synthesize(text)` call's audio as int16."""
    return _joined([d async for ev in tts.synthesize(text, **kw) if (d := pcm(ev)) is not None])
