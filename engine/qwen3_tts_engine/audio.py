"""The engine's one audio writer: float samples to s16le PCM, PCM to a mono WAV (bytes or file),
and PCM to OpenAI's compressed response formats, chunk by chunk (PyAV: ffmpeg's encoders)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np

from qwen3_tts_engine.protocol import SAMPLE_RATE, STREAMED_FORMATS


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


# response_format -> (ffmpeg muxer, encoder, bit rate, muxer options). The containers are the
# streamable ones: raw MP3 frames, Ogg pages (short pages: each chunk goes out at once), ADTS
# frames, a FLAC stream (the header's sample count stays 0 = unknown, as in any piped FLAC).
_CODECS: dict[str, tuple[str, str, int | None, dict[str, str]]] = {
    "mp3": ("mp3", "libmp3lame", 128_000, {"id3v2_version": "0", "write_xing": "0"}),
    "opus": ("ogg", "libopus", 96_000, {"page_duration": "20000"}),
    "aac": ("adts", "aac", 128_000, {}),
    "flac": ("flac", "flac", None, {}),
}


class _Sink:
    """A write-only, non-seekable file for the muxer: what it writes is taken after each chunk."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class AudioEncoder:
    """s16le mono PCM in, a response format's bytes out as soon as the encoder has them:
    `encode(pcm)` for each chunk, then `finish()` once (the encoder's delay and the trailer)."""

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE) -> None:
        if fmt not in STREAMED_FORMATS:
            raise ValueError(f"{fmt!r} is not a streamed format ({', '.join(STREAMED_FORMATS)})")
        self.format, self.sample_rate = fmt, sample_rate
        self._container = self._stream = None
        if fmt == "pcm":
            return
        import av  # ffmpeg's encoders; imported when a compressed format is asked for

        muxer, codec, bit_rate, options = _CODECS[fmt]
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        if bit_rate:
            self._stream.bit_rate = bit_rate
        self._frame = av.AudioFrame

    def encode(self, pcm: bytes) -> bytes:
        if self._stream is None:
            return pcm
        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = self._frame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self._stream is None:
            return b""
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        self._stream = None
        return self._sink.take()

    def close(self) -> None:
        """Release the encoder without output (a response that ended early)."""
        if self._stream is not None:
            self._container.close()
            self._stream = None


def encode_whole(pcm: bytes, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole response body in `fmt` (WAV with its exact header; PCM as is)."""
    if fmt == "wav":
        return wav_bytes(pcm, sample_rate)
    encoder = AudioEncoder(fmt, sample_rate)
    return encoder.encode(pcm) + encoder.finish()
