"""espeak-ng speech assets: sample rate, on-disk cache, helpers, and the missing-tool error."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from voice_agent.harness.speech_assets import (
    SpeechToolMissing,
    pad_silence,
    read_wav,
    speech_cache_dir,
    speech_samples,
    speech_wav,
)

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("sox") is None,
    reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
)

TEXT = "Please book a table for four people tomorrow"


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 48000])
def test_sample_rate_is_as_asked(tmp_path, rate):
    path = speech_wav(TEXT, sample_rate=rate, cache_dir=tmp_path)
    samples, got_rate = read_wav(path)

    assert got_rate == rate
    assert samples.dtype == np.int16 and samples.ndim == 1
    # espeak speaks this sentence in ~2.5 s at its default speed, whatever the rate
    assert 1.5 < len(samples) / rate < 4.0
    assert np.abs(samples.astype(np.int32)).max() > 3000  # real speech, not silence


def test_second_call_uses_cache(tmp_path, monkeypatch):
    first = speech_wav(TEXT, sample_rate=48000, cache_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    files = sorted(tmp_path.iterdir())

    # with no espeak-ng or sox on PATH, only a cache hit can succeed
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    second = speech_wav(TEXT, sample_rate=48000, cache_dir=tmp_path)

    assert second == first
    assert second.stat().st_mtime_ns == mtime
    assert sorted(tmp_path.iterdir()) == files  # no temporary leftovers, no new file


def test_cache_key_covers_text_voice_rate_and_speed(tmp_path):
    base = speech_wav(TEXT, sample_rate=16000, cache_dir=tmp_path)
    others = {
        speech_wav(TEXT + ".", sample_rate=16000, cache_dir=tmp_path),
        speech_wav(TEXT, sample_rate=24000, cache_dir=tmp_path),
        speech_wav(TEXT, sample_rate=16000, voice="en-gb", cache_dir=tmp_path),
        speech_wav(TEXT, sample_rate=16000, words_per_minute=220, cache_dir=tmp_path),
    }
    assert base not in others and len(others) == 4

    fast = speech_samples(TEXT, sample_rate=16000, words_per_minute=220, cache_dir=tmp_path)
    normal = speech_samples(TEXT, sample_rate=16000, cache_dir=tmp_path)
    assert len(fast) < 0.9 * len(normal)


def test_cache_dir_from_argument_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path / "root"))
    assert speech_cache_dir() == tmp_path / "root" / "speech"
    assert speech_cache_dir(tmp_path / "explicit") == tmp_path / "explicit"

    path = speech_wav("hello", sample_rate=16000)
    assert path.parent == tmp_path / "root" / "speech"

    monkeypatch.delenv("VOICE_AGENT_CACHE")
    assert str(speech_cache_dir()).endswith(".cache/qwen3-voice-agent/speech")


def test_missing_espeak_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    with pytest.raises(SpeechToolMissing, match="apt-get install espeak-ng sox"):
        speech_wav("not cached yet", sample_rate=16000, cache_dir=tmp_path)


def test_pad_silence():
    samples = np.arange(1, 101, dtype=np.int16)
    padded = pad_silence(samples, 1000, before=0.25, after=0.5)

    assert padded.dtype == np.int16
    assert len(padded) == 250 + 100 + 500
    assert not padded[:250].any() and not padded[350:].any()
    np.testing.assert_array_equal(padded[250:350], samples)
    with pytest.raises(ValueError):
        pad_silence(samples, 1000, before=-1)
