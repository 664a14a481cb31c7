"""Telephone audio: speech through a G.711 µ-law phone line (sox), heard by the agent's real
Silero VAD and faster-whisper (bundled tiny.en), compared with the same speech in wideband.

The numbers (word error both ways, VAD end of speech both ways) are printed as JSON and quoted in
docs/telephony.md.
"""

from __future__ import annotations

import asyncio
import json
import re
import wave

import numpy as np
import pytest
from livekit import rtc

from voice_agent.harness.phone_line import LINE_RATE, phone_line_wav
from voice_agent.harness.speech_assets import read_audio, speech_wav
from voice_agent.lab.turn_bench import word_error_rate

SENTENCES = (
    "What time is it right now?",
    "What is the capital of France?",
    "Can you recommend a good book to read?",
    "I would like to book a table for four people on Friday evening.",
    "Please transfer me to the billing department.",
    "My account number is one two three four five.",
    "I want to order a pizza with extra cheese and olives.",
    "Can you tell me the weather in London tomorrow morning?",
    "Please remind me to call my mother at six o'clock.",
    "How long will the delivery take?",
)
DIGITS = "zero one two three four five six seven eight nine".split()


def _spoken_digits(text: str) -> str:
    """'4' -> 'four', '1-2-3' -> 'one two three': whisper writes numbers as digits."""
    return re.sub(r"\d", lambda m: f" {DIGITS[int(m.group())]} ", text.replace("-", " "))


def test_the_phone_line_is_narrowband_mu_law_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path))
    wide = speech_wav(SENTENCES[0], sample_rate=48000)
    phone = phone_line_wav(wide, sample_rate=48000)
    with wave.open(str(phone)) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (48000, 2, 1)
    a, b = read_audio(wide, 48000).astype(np.float64), read_audio(phone, 48000).astype(np.float64)
    assert abs(len(a) - len(b)) < 48000 * 0.05  # same speech, same length

    def share_above(x: np.ndarray, hz: float) -> float:
        spectrum = np.abs(np.fft.rfft(x)) ** 2
        freqs = np.fft.rfftfreq(len(x), 1 / 48000)
        return float(spectrum[freqs > hz].sum() / spectrum.sum())

    # espeak-ng has energy above 4 kHz; after an 8 kHz line (band 300-3400 Hz) almost none
    assert share_above(a, LINE_RATE / 2) > 0.001
    assert share_above(b, LINE_RATE / 2) < share_above(a, LINE_RATE / 2) / 100
    mtime = phone.stat().st_mtime_ns
    assert phone_line_wav(wide, sample_rate=48000) == phone and phone.stat().st_mtime_ns == mtime
    with pytest.raises(FileNotFoundError):
        phone_line_wav(tmp_path / "missing.wav")


async def test_phone_line_speech_keeps_its_words_and_its_end_of_speech(
    bundled_path, tmp_path, monkeypatch
):
    """Word error on ten sentences, wideband and phone line, with the agent's own STT (beam 5)
    and VAD; the phone line may cost some words but not the sense of the set."""
    from livekit.plugins import faster_whisper, silero

    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path))
    stt = faster_whisper.STT(model=str(bundled_path))
    vad = silero.VAD.load(min_silence_duration=0.35)
    report: dict[str, dict] = {"wideband": {}, "phone": {}}
    for kind in report:
        errors, ends = [], []
        for text in SENTENCES:
            wav = speech_wav(text, sample_rate=48000)
            wav = phone_line_wav(wav, sample_rate=48000) if kind == "phone" else wav
            samples = read_audio(wav, 48000)
            frame = rtc.AudioFrame(samples.tobytes(), 48000, 1, len(samples))
            heard = (await stt.recognize(frame)).alternatives[0].text
            errors.append(word_error_rate(_spoken_digits(text), _spoken_digits(heard)))
            ends.append(await _vad_end_of_speech(vad, samples))
        report[kind] = {"wer": round(float(np.mean(errors)), 3), "vad_end_s": ends}
    await stt.aclose()
    shift = [
        p - w
        for p, w in zip(report["phone"]["vad_end_s"], report["wideband"]["vad_end_s"], strict=True)
    ]
    report["vad_end_shift_s_max"] = round(max(map(abs, shift)), 3)
    print(json.dumps({"phone_line_vs_wideband": report}))
    assert report["wideband"]["wer"] <= 0.25, report
    assert report["phone"]["wer"] <= report["wideband"]["wer"] + 0.2, report
    assert all(e is not None for k in ("wideband", "phone") for e in report[k]["vad_end_s"]), report
    assert report["vad_end_shift_s_max"] <= 0.2, (
        report
    )  # Silero ends the phone speech where it ends the wideband one


async def _vad_end_of_speech(vad, samples: np.ndarray) -> float | None:
    """Silero's END_OF_SPEECH time (s, on the audio's own clock) after one second of silence."""
    from livekit.agents.vad import VADEventType

    tail = 96000 + (-len(samples)) % 480  # whole 10 ms frames
    audio = np.concatenate([np.zeros(48000, np.int16), samples, np.zeros(tail, np.int16)])
    stream = vad.stream()
    for i in range(0, len(audio), 480):
        stream.push_frame(rtc.AudioFrame(audio[i : i + 480].tobytes(), 48000, 1, 480))
    stream.end_input()
    end = None
    async for ev in stream:
        if ev.type == VADEventType.END_OF_SPEECH and end is None:
            end = round(ev.timestamp, 3)
    await asyncio.sleep(0)
    return end
