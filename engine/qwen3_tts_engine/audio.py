"""The engine's one audio writer: float samples to s16le PCM, PCM to a mono WAV (bytes or file)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np

from .protocol import SAMPLE_RATE


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped) as little-endian 16-bit PCM."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _write(target, pcm: bytes, sample_rate: int) -> None:
    with wave.open(target, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)


def wav_bytes(pcm: bytes, sample_rate: int = SAMPLE_RATE) -> bytes:
    buf = io.BytesIO()
    _write(buf, pcm, sample_rate)
    return buf.getvalue()


def write_wav(path: Path, pcm: bytes, sample_rate: int = SAMPLE_RATE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(str(path), pcm, sample_rate)
