"""`voice-agent demo`: spoken turns from audio files through the whole pipeline, no LiveKit server.

Every input is checked before anything starts (turn files, the output path; the voice once the
engine answers, before the LLM starts). Writes the agent's reply audio as a WAV file and prints a
per-turn latency table (or JSON); a turn that fails ends the run with one line saying why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import wave
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from voice_agent.harness.audio_io import CaptureAudioOutput, PacedAudioInput
from voice_agent.harness.conversation import Conversation, InParts, TurnFailed, TurnReport
from voice_agent.harness.speech_assets import AudioFileError, read_audio, speech_wav
from voice_agent.observability import TurnMetrics, start_metrics_server
from voice_agent.pipeline import VoiceAgent, build_session, build_stt
from voice_agent.services import RANDOM_LLM, RANDOM_TTS, ensure_llm, ensure_tts_engine
from voice_agent.settings import Settings

DEFAULT_QUESTION = "Hello there. What time is it right now?"
INPUT_RATE = 48000  # a LiveKit room's rate


class TurnAudioError(ValueError):
    """A user turn that cannot be used: a missing file, not audio, no samples, or only silence."""


SILENT = 0.001  # peak below this fraction of full scale (-60 dBFS): nothing for the VAD to hear


def load_turn_audio(path: Path | None) -> np.ndarray:
    """int16 mono at 48 kHz from an audio file (any format, rate, sample size and channel
    count FFmpeg decodes), or espeak-ng's default question."""
    wav = path or speech_wav(DEFAULT_QUESTION, sample_rate=INPUT_RATE)
    try:
        samples = read_audio(wav, INPUT_RATE)
    except AudioFileError as e:
        raise TurnAudioError(str(e)) from None
    if np.abs(samples.astype(np.int32)).max() < SILENT * 32767:
        raise TurnAudioError(f"{wav} is silent: nothing in it for the agent to hear")
    return trim_silence(samples)


def trim_silence(samples: np.ndarray, threshold: float = 0.02) -> np.ndarray:
    """Cut leading/trailing silence, so that "the last sample sent" is the end of speech."""
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > threshold * 32767)
    return samples[loud[0] : loud[-1] + 1] if len(loud) else samples


async def run_turns(settings: Settings, turns: list[np.ndarray | InParts], *, tts_url: str, llm_url: str,
                    turn_timeout: float = 300.0, agent: VoiceAgent | None = None,
                    on_start=None) -> list[TurnReport]:  # fmt: skip
    """Each turn: the utterance (or its parts, with the waits between them: `InParts`), then
    microphone silence until the agent has answered.

    A turn whose TTS, STT or LLM fails for good raises `TurnFailed` at once ("turn N: the TTS
    failed: <the engine's message>"); a turn the agent answered despite a failure (its apology
    for a failed LLM) ends the run after its report, which lists the failure in `errors`.
    """
    stt = build_stt(settings)
    await asyncio.to_thread(stt.load)  # as a worker's prewarm does: not on the first turn
    session = build_session(settings, tts_url=tts_url, llm_url=llm_url, stt=stt, echo_free=True)
    agent = agent or VoiceAgent(settings.instructions)
    conversation = Conversation(session, PacedAudioInput(INPUT_RATE), CaptureAudioOutput(24000),
                                answers_llm_errors=isinstance(agent, VoiceAgent))  # fmt: skip
    TurnMetrics(session)
    metrics_server = (
        await start_metrics_server(settings.metrics_port) if settings.metrics_port else None
    )
    await session.start(agent)
    if on_start is not None:
        on_start(conversation)
    reports: list[TurnReport] = []
    quiet, livekit_log = _ReportedErrors(conversation), logging.getLogger("livekit.agents")
    livekit_log.addFilter(quiet)
    try:
        for i, speech in enumerate(turns, 1):
            try:
                reports.append(await conversation.turn(speech, timeout=turn_timeout))
            except (TurnFailed, TimeoutError) as e:
                raise type(e)(f"turn {i}: {e}") from None
            if reports[-1].errors:
                break
        return reports
    finally:
        await session.aclose()
        await conversation.audio_in.aclose()
        if session.tts is not None:  # outside a job nobody else closes the plugin's sockets
            await session.tts.aclose()
        livekit_log.removeFilter(quiet)
        if metrics_server is not None:
            await metrics_server.cleanup()


class _ReportedErrors(logging.Filter):
    """Drops LiveKit's log record (with its traceback) of a failure the conversation reports
    itself, in one line."""

    def __init__(self, conversation: Conversation) -> None:
        super().__init__()
        self.conversation = conversation

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not any(exc is e for e in self.conversation.failures)


def write_replies(path: Path, reports: list[TurnReport]) -> None:
    gap = np.zeros(12000, np.int16)
    audio = np.concatenate(
        [x for r in reports for x in (r.reply_audio, gap) if x is not None] or [gap]
    )
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
              f"{r.transcript!r} -> {'(said nothing)' if r.silent else repr(r.reply_text[:60])}")  # fmt: skip


def check_output(out: Path) -> None:
    """The reply WAV can be written (checked before anything starts)."""
    if out.is_dir():
        raise RuntimeError(f"--out {out} is a directory: give a file (e.g. {out / 'reply.wav'})")
    if out.parent.exists() and not out.parent.is_dir():
        raise RuntimeError(f"--out {out}: {out.parent} is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"--out {out}: cannot create {out.parent}: {e.strerror or e}") from None
    if not os.access(out.parent, os.W_OK):
        raise RuntimeError(f"--out {out}: {out.parent} is not writable")


def check_voice(settings: Settings, url: str) -> None:
    """The engine at `url` has the voice the settings name: a wrong one is an error before the
    LLM starts, not a failed turn. Skipped for vLLM-Omni, an engine that does not say, or one
    that cannot be asked (the turn then fails with the engine's own message)."""
    if settings.tts_protocol != "qwen3-tts":
        return
    try:
        r = httpx.get(f"{url.split(',')[0].rstrip('/')}/v1/models", timeout=10)
        card = r.json()["data"][0] if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return
    voices = [str(v) for v in card.get("voices") or []]
    aliases = [str(a) for a in card.get("voice_aliases") or {}]
    if voices and settings.tts_voice.lower() not in {v.lower() for v in voices + aliases}:
        raise RuntimeError(f"the TTS engine has no voice {settings.tts_voice!r} (--tts-voice, "
                           f"TTS_VOICE); voices: {', '.join(voices)}")  # fmt: skip


def run_demo(settings: Settings, wavs: list[Path], out: Path, as_json: bool) -> int:
    # the input first: a bad file fails before any engine or LLM starts
    turns = [load_turn_audio(w) for w in wavs] or [load_turn_audio(None)]
    check_output(out)
    tts = ensure_tts_engine(settings)
    llm_svc = None
    try:
        check_voice(settings, tts.url)
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
    failed = next(((i, r) for i, r in enumerate(reports, 1) if r.errors), None)
    if failed is not None:  # the agent answered (its apology), but the turn did fail
        raise TurnFailed(f"turn {failed[0]}: {failed[1].errors[0]} (the agent said: "
                         f"{failed[1].reply_text[:60]!r})")  # fmt: skip
    return 0
