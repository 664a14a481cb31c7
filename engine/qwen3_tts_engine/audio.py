"""The engine's one audio writer: float samples to s16le PCM, PCM to a mono WAV (bytes or file),
PCM to OpenAI's compressed response formats, chunk by chunk (PyAV: ffmpeg's encoders), and PCM
from the model's 24 kHz to a request's `sample_rate`, chunk by chunk (`Resampler`)."""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path

import numpy as np

from qwen3_tts_engine.protocol import SAMPLE_RATE, STREAMED_FORMATS


class Resampler:
    """s16le mono PCM from `from_rate` to `to_rate`, chunk by chunk, without clicks at the
    chunks' seams: a polyphase FIR (scipy's `resample_poly` filter: a Kaiser-windowed sinc,
    beta 5, 10 zero crossings of the lower rate each side) whose input history and output phase
    are carried from one `process()` call to the next.

    Tolerance: none. Streamed output is *exactly* equal (bit for bit, 0 LSB) to one-shot output
    (the whole PCM in one call), however the input is cut: each output sample is the same sum of
    the same products in the same order (elementwise float64), rounded to int16 once.

    The filter is causal: after n input samples exactly ceil(n * to_rate / from_rate) output
    samples have come out in all (each chunk gives its share to within one sample), and the
    output lags by the filter's group delay (10 samples of the output at 8 or 16 kHz, 20 at
    48 kHz: under 1.3 ms); equivalently, `upfirdn(h, x, up, down)` cut to that length. A stream
    that ends needs no flush. Same rates: the PCM passes through unchanged."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        if from_rate <= 0 or to_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
        g = math.gcd(from_rate, to_rate)
        self.from_rate, self.to_rate = from_rate, to_rate
        self.up, self.down = to_rate // g, from_rate // g
        self._consumed = 0  # input samples taken so far
        self._produced = 0  # output samples given so far
        if self.up == self.down:
            return
        h = lowpass_filter(self.up, self.down)
        taps = -(-len(h) // self.up)  # taps per phase
        padded = np.zeros(taps * self.up)
        padded[: len(h)] = h
        self._phases = padded.reshape(taps, self.up).T.copy()  # [p, k] = h[p + k * up]
        self._history = np.zeros(taps - 1)  # the last taps - 1 input samples (zeros before)

    def process(self, pcm: bytes) -> bytes:
        """The output samples that `pcm` (whole s16le samples) completes, as s16le bytes."""
        if len(pcm) % 2:
            raise ValueError("s16le PCM comes in whole 2-byte samples")
        if self.up == self.down:
            return pcm
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
        taps = self._phases.shape[1]
        buf = np.concatenate([self._history, x])  # buf[i] is input sample i + consumed - taps + 1
        consumed = self._consumed + len(x)
        end = -(-consumed * self.up // self.down)  # ceil: outputs whose newest input is here
        t = np.arange(self._produced, end, dtype=np.int64) * self.down  # upsampled positions
        # each output's newest input sample, as an index in buf
        newest = t // self.up - (self._consumed - taps + 1)
        coef = self._phases[t % self.up]  # each output's phase of the filter, (outputs, taps)
        acc = np.zeros(len(t))
        for k in range(taps):  # a fixed order: the same sum whatever the chunks
            acc += coef[:, k] * buf[newest - k]
        self._history = buf[len(buf) - (taps - 1) :]
        self._consumed, self._produced = consumed, end
        return np.clip(np.rint(acc), -32768, 32767).astype("<i2").tobytes()


def lowpass_filter(up: int, down: int) -> np.ndarray:
    """scipy.signal.resample_poly's default filter for `up`/`down` (coprime): firwin of
    2 * 10 * max(up, down) + 1 taps, cutoff 1 / max(up, down) of Nyquist, Kaiser window beta 5,
    unit DC gain, times `up`."""
    rate = max(up, down)
    half = 10 * rate
    n = np.arange(-half, half + 1)
    h = np.sinc(n / rate) * np.kaiser(2 * half + 1, 5.0)
    return h / h.sum() * up


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped) as little-endian 16-bit PCM."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def leading_silence_s(pcm: bytes | np.ndarray, sample_rate: int = SAMPLE_RATE,
                      threshold_dbfs: float = -40.0, window_s: float = 0.005) -> float:  # fmt: skip
    """Seconds of silence before the first audible sample: the first sample above
    `threshold_dbfs` in the first `window_s` window whose RMS is above it (a lone click below
    it does not count). `pcm`: s16le bytes, int16 samples, or float samples in [-1, 1]. All
    of the audio when none is audible. First audible = first chunk's arrival + this (as Coval's
    TTS benchmark counts it: playback starts with the first chunk)."""
    if isinstance(pcm, bytes | bytearray | memoryview):
        pcm = np.frombuffer(pcm, "<i2")
    x = np.asarray(pcm)
    x = x.astype(np.float64) / 32768.0 if x.dtype.kind in "iu" else x.astype(np.float64)
    if not len(x):
        return 0.0
    level = 10 ** (threshold_dbfs / 20)
    w = max(1, min(len(x), round(window_s * sample_rate)))
    energy = np.concatenate([[0.0], np.cumsum(x * x)])
    loud = np.flatnonzero((energy[w:] - energy[:-w]) / w > level * level)
    if not len(loud):
        return len(x) / sample_rate
    start = int(loud[0])
    return (start + int(np.argmax(np.abs(x[start : start + w]) > level))) / sample_rate


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
