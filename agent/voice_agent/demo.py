"""`voice-agent demo`: spoken turns from WAV files through the whole pipeline, no LiveKit server.

Writes the agent's reply audio as a WAV file and prints a per-turn latency table (or JSON).
"""

from __future__ import annotations

import asyncio
import json
import sys
import wave
from dataclasses import replace
from pathlib import Path

import numpy as np

from .audio_io import CaptureAudioOutput, PacedAudioInput
from .conversation import Conversation, TurnReport
from .local_services import RANDOM_LLM, RANDOM_TTS, ensure_llm, ensure_tts_engine
from .observability import TurnMetrics, start_metrics_server
from .pipeline import VoiceAgent, build_session, build_stt
from .settings import Settings

DEFAULT_QUESTION = "Hello there. What time is it right now?"
INPUT_RATE = 48000  # a LiveKit room's rate


class TurnAudioError(ValueError):
    """A user turn that cannot be read as a 16-bit PCM WAV file."""


def load_turn_audio(path: Path | None) -> np.ndarray:
    """int16 mono at 48 kHz, from a WAV file (any rate) or espeak-ng's default question."""
    from .speech_assets import read_wav, speech_wav

    wav = path or speech_wav(DEFAULT_QUESTION, sample_rate=INPUT_RATE)
    try:
        samples, rate = read_wav(wav)
    except (OSError, EOFError, wave.Error, ValueError) as e:
        raise TurnAudioError(f"{wav} is not a readable 16-bit PCM WAV file: {e}") from None
    if rate != INPUT_RATE:
        from livekit import rtc

        resampler = rtc.AudioResampler(rate, INPUT_RATE, quality=rtc.AudioResamplerQuality.HIGH)
        frames = resampler.push(rtc.AudioFrame(samples.tobytes(), rate, 1, len(samples)))
        frames += resampler.flush()
        samples = np.concatenate([np.frombuffer(bytes(f.data), np.int16) for f in frames])
    return trim_silence(samples)


def trim_silence(samples: np.ndarray, threshold: float = 0.02) -> np.ndarray:
    """Cut leading/trailing silence, so that "the last sample sent" is the end of speech."""
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > threshold * 32767)
    return samples[loud[0] : loud[-1] + 1] if len(loud) else samples


async def run_turns(settings: Settings, turns: list[np.ndarray], *, tts_url: str, llm_url: str,
                    turn_timeout: float = 300.0, agent: VoiceAgent | None = None,
                    on_start=None) -> list[TurnReport]:  # fmt: skip
    """Each turn: the utterance, then microphone silence until the agent has answered."""
    stt = build_stt(settings)
    await asyncio.to_thread(stt.load)  # as a worker's prewarm does: not on the first turn
    session = build_session(settings, tts_url=tts_url, llm_url=llm_url, stt=stt, echo_free=True)
    conversation = Conversation(session, PacedAudioInput(INPUT_RATE), CaptureAudioOutput(24000))
    TurnMetrics(session)
    metrics_server = await start_metrics_server(settings.metrics_port) if settings.metrics_port else None
    agent = agent or VoiceAgent(settings.instructions)
    await session.start(agent)
    if on_start is not None:
        on_start(conversation)
    try:
        return [await conversation.turn(t, timeout=turn_timeout) for t in turns]
    finally:
        await session.aclose()
        await conversation.audio_in.aclose()
        if metrics_server is not None:
            await metrics_server.cleanup()


def write_replies(path: Path, reports: list[TurnReport]) -> None:
    gap = np.zeros(12000, np.int16)
    audio = np.concatenate([x for r in reports for x in (r.reply_audio, gap) if x is not None] or [gap])
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(audio.tobytes())


def _fmt(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def print_table(reports: list[TurnReport]) -> None:
    print(f"{'turn':>4}  {'EOT ms':>7} {'STT ms':>7} {'LLM TTFT':>8} {'TTS TTFB':>8} "
          f"{'V2V ms':>7} {'reply s':>7}  transcript -> reply")  # fmt: skip
    for i, r in enumerate(reports, 1):
        print(f"{i:>4}  {_fmt(r.end_of_turn_delay_s):>7} {_fmt(r.stt_s):>7} {_fmt(r.llm_ttft_s):>8} "
              f"{_fmt(r.tts_ttfb_s):>8} {_fmt(r.voice_to_voice_s):>7} {r.reply_audio_s:>7.2f}  "
              f"{r.transcript!r} -> {r.reply_text[:60]!r}")  # fmt: skip


def run_demo(settings: Settings, wavs: list[Path], out: Path, as_json: bool) -> int:
    # the input first: a bad file fails before any engine or LLM starts
    turns = [load_turn_audio(w) for w in wavs] or [load_turn_audio(None)]
    tts = ensure_tts_engine(settings)
    llm_svc = None
    try:
        llm_svc = ensure_llm(settings)
        notes = [*tts.notes, *llm_svc.notes]
        if llm_svc.model:
            settings = replace(settings, llm_model=llm_svc.model)
        if RANDOM_TTS in notes or RANDOM_LLM in notes:
            # random models never stop on their own: keep the demo short
            settings = replace(settings, llm_max_tokens=min(settings.llm_max_tokens, 12),
                               llm_temperature=settings.llm_temperature or 1.0,
                               tts_max_new_tokens=settings.tts_max_new_tokens or 8)  # fmt: skip
        for note in notes:
            print(f"NOTE: {note}", file=sys.stderr)
        reports = asyncio.run(run_turns(settings, turns, tts_url=tts.url, llm_url=llm_svc.url))
    finally:
        tts.stop()
        if llm_svc is not None:
            llm_svc.stop()
    write_replies(out, reports)
    if as_json:
        print(json.dumps({"turns": [r.to_json() for r in reports], "reply_wav": str(out),
                          "notes": notes}, indent=2))  # fmt: skip
    else:
        print_table(reports)
        print(f"reply audio -> {out}")
    return 0
