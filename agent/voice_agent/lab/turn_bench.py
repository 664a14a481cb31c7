"""Spoken turn sets for `voice-agent bench`: plain questions and questions with a pause in the
middle (espeak-ng speech, silence spliced in), and the pipeline settings as they were before the
turn-taking work (the baseline every run compares against)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.settings import Settings

PLAIN = (
    "Hello there. What time is it right now?",
    "What is the capital of France?",
    "Can you recommend a good book to read?",
)
# (before the pause, pause seconds, after it): a turn committed at the pause is cut too early
# (tiny.en hears the first part of the last one as "...a table for it.", a finished sentence)
PAUSED = (
    ("I want to order a pizza with", 0.7, "extra cheese and olives."),
    ("Can you tell me the weather in", 0.5, "London tomorrow morning?"),
    ("I need a taxi to the airport and", 0.9, "a hotel room for tonight."),
    ("Please remind me to call my", 0.3, "mother at six o'clock."),
    ("I would like to book a table for", 0.7, "four people on Friday evening."),
)


@dataclass
class SpokenTurn:
    kind: str  # "plain" or "paused"
    text: str
    audio: np.ndarray  # int16 at `rate`
    pause_s: float = 0.0


def _speech(text: str, rate: int) -> np.ndarray:
    return load_turn_audio(speech_wav(text, sample_rate=rate))


def turn_set(plain: int, paused: int, rate: int = 48000) -> list[SpokenTurn]:
    turns = [SpokenTurn("plain", PLAIN[i % len(PLAIN)], _speech(PLAIN[i % len(PLAIN)], rate))
             for i in range(plain)]  # fmt: skip
    for i in range(paused):
        before, pause, after = PAUSED[i % len(PAUSED)]
        audio = np.concatenate([_speech(before, rate), np.zeros(int(pause * rate), np.int16),
                                _speech(after, rate)])  # fmt: skip
        turns.append(SpokenTurn("paused", f"{before} {after}", audio, pause))
    return turns


def baseline(settings: Settings) -> Settings:
    """The pipeline's settings before the turn-taking work: LiveKit's VAD window (0.55 s), its
    endpointing delays, the whole utterance transcribed once it has ended, no check on the
    transcript, no preemptive generation, whole sentences to the TTS with 4-frame first chunks
    (no streamed text)."""
    return replace(settings, stt_streaming=False, stt_encoder_context=30.0, vad_min_silence=0.55, endpointing_min_delay=0.5,
                   endpointing_max_delay=3.0, turn_detector="none", preemptive_generation=False, preemptive_tts=False,
                   tts_first_clause_words=0, tts_first_clause_chunk_frames=4, tts_text_input="sentences")  # fmt: skip


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over words / reference length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))
