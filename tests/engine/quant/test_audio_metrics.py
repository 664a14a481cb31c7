"""Audio metrics of the quantization-quality report: MR-STFT and log-mel distances on synthetic
signals, CER on known strings, and Whisper / Silero on real espeak-ng speech.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from qwen3_tts_engine.quant import audio_metrics as am

RATE = 24000  # Qwen3-TTS's output rate: the Whisper/Silero tests go through resampling
SENTENCE = "Please send the report to Alice before Friday afternoon"
needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("sox") is None,
    reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
)


def voiced(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    """A speech-like test signal: a gliding harmonic tone, amplitude-modulated, plus faint noise."""
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 140 + 40 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    x = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    x += 1e-3 * np.random.default_rng(seed).standard_normal(len(t))
    return (0.2 * x).astype(np.float32)


def noisy(x: np.ndarray, level: float, seed: int = 1) -> np.ndarray:
    return (x + level * np.random.default_rng(seed).standard_normal(len(x))).astype(np.float32)


@pytest.mark.parametrize("metric", [am.mrstft_distance, am.log_mel_distance])
def test_spectral_distance_is_zero_for_identical_and_grows_with_noise(metric):
    x = voiced()
    assert metric(x, x.copy(), RATE) == 0.0
    assert metric(x[:-300], x, RATE) == 0.0  # trimmed to the shorter signal
    levels = [0.003, 0.01, 0.03]
    d = [metric(noisy(x, lv), x, RATE) for lv in levels]
    assert 0 < d[0] < d[1] < d[2], d
    # symmetric-ish: log terms are symmetric, spectral convergence divides by the reference
    for lv, dist in zip(levels, d, strict=True):
        assert metric(x, noisy(x, lv), RATE) == pytest.approx(dist, rel=0.05)


def test_spectral_distance_accepts_int16_and_rejects_empty():
    x = voiced()
    pcm = np.round(x * 32767).astype(np.int16)
    assert am.mrstft_distance(pcm, x, RATE) < 0.05  # int16 is scaled to [-1, 1]
    with pytest.raises(ValueError):
        am.log_mel_distance(np.zeros(0, np.float32), x, RATE)


def test_slaney_mel_filterbank():
    assert am._hz_to_mel(1000.0) == pytest.approx(15.0)  # Slaney: 1 kHz is mel 15
    hz = np.array([100.0, 999.0, 1000.0, 4000.0, 11000.0])
    assert am._mel_to_hz(am._hz_to_mel(hz)) == pytest.approx(hz)
    fb = am.mel_filterbank(RATE, 1024, 80)
    assert fb.shape == (80, 513) and (fb.max(axis=1) > 0).all()
    # area normalisation: every triangle integrates to ~1 over Hz (wide upper bands: exactly)
    assert fb[40:].sum(axis=1) * RATE / 1024 == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize(
    ("ref", "hyp", "cer"),
    [
        ("kitten", "sitting", 3 / 6),
        ("Kitten!", "  SITTING. ", 3 / 6),  # case, punctuation and spaces are normalised away
        ("Hello, world!", "hello   world", 0.0),
        ("Don't stop", "dont stop", 0.0),
        ("well-known", "well known", 0.0),
        ("", "", 0.0),
        ("", "uh", 1.0),
        ("abc", "", 1.0),
    ],
)
def test_character_error_rate(ref, hyp, cer):
    assert am.character_error_rate(ref, hyp) == pytest.approx(cer)


def test_resample_keeps_duration_and_tone():
    t = np.arange(RATE) / RATE
    y = am.resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), RATE)
    assert len(y) == am.MODEL_RATE
    spectrum = np.abs(np.fft.rfft(y))
    assert np.argmax(spectrum) == 440  # 1 s at 16 kHz: bin = Hz


@needs_espeak
def test_transcribe_and_speech_fraction_on_espeak_speech():
    from voice_agent.harness.speech_assets import speech_samples

    speech = am.as_float_audio(speech_samples(SENTENCE, sample_rate=RATE))
    text = am.transcribe(speech, RATE)
    assert am.character_error_rate(SENTENCE, text) < 0.35, text
    assert am.speech_fraction(speech, RATE) > 0.5


def test_speech_fraction_of_silence_and_low_noise():
    silence = np.zeros(2 * RATE, np.float32)
    hiss = noisy(silence, 0.003)
    assert am.speech_fraction(silence, RATE) < 0.1
    assert am.speech_fraction(hiss, RATE) < 0.1
    assert len(am.speech_probabilities(hiss, RATE)) == 2 * am.MODEL_RATE // 512
    assert am.speech_fraction(np.zeros(100, np.float32), RATE) == 0.0  # shorter than a window
