"""The voice agent end to end, offline, without a LiveKit server: espeak-ng speech at 48 kHz →
real Silero → real faster-whisper tiny.en → an OpenAI-compatible chat server on loopback →
the Qwen3-TTS plugin → a real engine server on a tiny checkpoint → captured audio."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.engine_process import free_port
from voice_agent.harness.demo import load_turn_audio, run_turns
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.pipeline import APOLOGY, VoiceAgent, build_tts
from voice_agent.services import ensure_llm
from voice_agent.settings import Settings

pytestmark = pytest.mark.slow
# The engine's checkpoint ends each sentence by EOS (about one frame per text token), as a real
# model does; the agent sends no frame cap unless a test sets one.
SEGMENT_MARKER = 240  # LiveKit closes a TTS segment with at most a 10 ms frame at 24 kHz


def _settings(engine, llm_url: str, **kw) -> Settings:
    # no standby (TTS_HOLD_AFTER=0): its phrases, synthesized as a session starts, would join the
    # engine history these tests read (the standby's own tests: test_no_dead_air.py)
    kw = {"tts_hold_after": 0, **kw}
    return Settings(tts_url=f"http://127.0.0.1:{engine.port}", llm_base_url=llm_url, llm_model="scripted",
                    offline=True, tts_max_new_tokens=kw.pop("frames", None), **kw)  # fmt: skip


def _question(text: str):
    return load_turn_audio(speech_wav(text, sample_rate=48000))


async def test_turn_with_tool_call_end_to_end(engine):
    llm = await ScriptedChatServer().start()
    handler = engine.engine.active
    before = len(handler.history)
    agent = VoiceAgent("You are a test agent.")
    try:
        (report,) = await run_turns(_settings(engine, llm.url), [_question("What time is it right now?")],
                                    tts_url=f"http://127.0.0.1:{engine.port}", llm_url=llm.url,
                                    agent=agent, turn_timeout=180)  # fmt: skip
    finally:
        await llm.stop()
    words = report.transcript.lower()
    assert "time" in words and "what" in words, report.transcript
    assert report.tool_calls == ["get_current_time"] and agent.tool_calls == ["get_current_time"]
    assert any(m.get("role") == "tool" and "It is" in m.get("content", "")
               for m in llm.requests[-1]["messages"])  # fmt: skip
    assert "noon" in report.reply_text
    # The reply audio is exactly what the engine made for this turn's sentences.
    syntheses = list(handler.history)[before:]
    assert syntheses and all(not s["cancelled"] for s in syntheses)
    assert not any(s["hit_token_cap"] for s in syntheses), syntheses  # every sentence ended by EOS
    # TTS_TEXT_INPUT auto (the default) streamed the reply's text over the engine's socket: the
    # dual-track layout, which a POST for this CustomVoice checkpoint never gets unasked
    assert Settings().tts_text_input == "auto"
    assert [s["text_mode"] for s in syntheses] == ["dual"] * len(syntheses), syntheses
    engine_samples = sum(s["frames"] for s in syntheses) * 1920
    assert engine_samples > 0
    assert 0 <= len(report.reply_audio) - engine_samples <= SEGMENT_MARKER, (
        len(report.reply_audio),
        engine_samples,
    )
    # LiveKit's per-turn metrics are there
    for name in ("end_of_turn_delay_s", "transcription_delay_s", "llm_ttft_s", "tts_ttfb_s",
                 "e2e_latency_s", "voice_to_voice_s", "stt_s"):  # fmt: skip
        assert getattr(report, name) is not None and getattr(report, name) >= 0, name
    # ...and exported to Prometheus
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("voice_agent_e2e_latency_seconds_count") >= 1
    assert REGISTRY.get_sample_value("voice_agent_llm_node_ttft_seconds_count") >= 1


async def test_tts_text_input_reaches_the_plugin():
    for mode in ("auto", "stream", "sentences"):
        tts = build_tts(Settings(tts_text_input=mode), "http://127.0.0.1:9")
        try:
            assert tts._opts.text_input == mode
        finally:
            await tts.aclose()


async def test_a_phone_call_asks_the_engine_for_phone_rate_audio():
    """A caller of kind SIP: the TTS asks for (and says) PHONE_SAMPLE_RATE; others get 24 kHz;
    vLLM-Omni, which has no such field, keeps 24 kHz (LiveKit resamples)."""
    from voice_agent.telephony import PHONE_SAMPLE_RATE

    cases = [(Settings(), True, PHONE_SAMPLE_RATE), (Settings(), False, 24000),
             (Settings(tts_protocol="vllm-omni"), True, 24000)]  # fmt: skip
    for settings, phone, rate in cases:
        tts = build_tts(settings, "http://127.0.0.1:9", phone=phone)
        try:
            assert tts.sample_rate == tts._opts.sample_rate == rate
        finally:
            await tts.aclose()
    assert PHONE_SAMPLE_RATE == 16000


async def test_barge_in_stops_agent_audio_and_cancels_tts(engine):
    long_answer = ("This is a long answer. " * 6).strip()
    llm = await ScriptedChatServer(long_answer, use_tool=False).start()
    handler = engine.engine.active
    before = len(handler.history)
    interrupt = _question("Stop, please stop talking now.")
    state: dict = {}

    def on_start(conversation):
        state["conv"] = conversation

        async def barge_in_when_agent_speaks():
            out = conversation.audio_out
            while not out.frames:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            conversation.audio_in.play(interrupt)

        state["task"] = asyncio.create_task(barge_in_when_agent_speaks())

    try:
        reports = await run_turns(_settings(engine, llm.url), [_question("Tell me a story.")],
                                  tts_url=f"http://127.0.0.1:{engine.port}", llm_url=llm.url,
                                  on_start=on_start, turn_timeout=180)  # fmt: skip
    finally:
        state["task"].cancel()
        await llm.stop()
    report = reports[0]
    out = state["conv"].audio_out
    assert report.interrupted and out.interruptions
    t_interrupt, played = out.interruptions[0]
    # After the interruption no more than one chunk (320 ms) of the agent's audio goes out.
    after = out.audio_since(t_interrupt)
    assert len(after) <= 7680, len(after)
    assert played < report.reply_audio_s + 0.5
    # ...and the TTS request was cancelled on the server.
    async with asyncio.timeout(120):  # a hang guard: the engine ends the cancelled request
        while handler.queue_depth != 0:
            await asyncio.sleep(0.1)
    syntheses = list(handler.history)[before:]
    assert any(s["cancelled"] for s in syntheses), syntheses
    # Far from the whole answer: six sentences, each ending by EOS at about `whole` frames.
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{engine.port}", timeout=120) as c:
        r = await c.post("/v1/audio/speech", json={"input": "This is a long answer.", "voice": "ryan",
                                                   "response_format": "pcm", "seed": 1})  # fmt: skip
    whole = len(r.content) // (2 * 1920)
    assert whole >= 4 and sum(s["frames"] for s in syntheses) < 3 * whole, (whole, syntheses)


async def test_llm_failure_is_a_spoken_apology(engine):
    llm = await ScriptedChatServer(fail=True).start()
    try:
        (report,) = await run_turns(_settings(engine, llm.url), [_question("Are you there?")],
                                    tts_url=f"http://127.0.0.1:{engine.port}", llm_url=llm.url,
                                    turn_timeout=180)  # fmt: skip
    finally:
        await llm.stop()
    assert report.reply_text == APOLOGY
    assert report.reply_audio_s > 0


async def test_a_reply_without_words_ends_the_turn(engine):
    """An LLM that answers nothing: LiveKit adds no assistant message; the turn still ends (it
    used to wait for its timeout) and says so."""
    llm = await ScriptedChatServer("", use_tool=False).start()
    settings = _settings(engine, llm.url)
    try:
        silent, = await run_turns(settings, [_question("Are you there?")], tts_url=settings.tts_url,
                                  llm_url=llm.url, turn_timeout=180)  # fmt: skip
    finally:
        await llm.stop()
    assert silent.silent and silent.reply_text == "" and silent.reply_audio_s == 0
    assert "there" in silent.transcript.lower() and len(llm.requests) == 1


async def test_a_turn_without_a_reply_times_out_with_what_happened(engine):
    llm = await ScriptedChatServer().start()
    settings = _settings(engine, llm.url)
    quiet = np.zeros(48000, np.int16)  # one second of silence: nobody speaks, nobody answers
    try:
        with pytest.raises(TimeoutError) as e:
            await run_turns(
                settings, [quiet], tts_url=settings.tts_url, llm_url=llm.url, turn_timeout=2
            )
    finally:
        await llm.stop()
    message = str(e.value)
    assert message.startswith("turn 1: no reply from the agent within 2 s; this turn (s from the end "
                              "of the utterance): "), message  # fmt: skip
    assert "user speaking" not in message and "transcript" not in message, message
    assert llm.requests == []


async def test_local_mlx_lm_server_answers_a_turn(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path))
    settings = Settings(tts_url=f"http://127.0.0.1:{engine.port}", llm_port=free_port(), offline=True,
                        tts_max_new_tokens=4, llm_max_tokens=8, llm_temperature=1.0)  # fmt: skip
    service = await asyncio.to_thread(ensure_llm, settings)
    try:
        assert service.proc is not None and "RANDOM" in service.notes[0]
        settings.llm_model = service.model
        (report,) = await run_turns(settings, [_question("Hello, can you hear me?")],
                                    tts_url=settings.tts_url, llm_url=service.url, turn_timeout=180)  # fmt: skip
    finally:
        service.stop()
    assert report.llm_ttft_s is not None and report.reply_text.strip()
    assert report.reply_text != APOLOGY
    assert report.reply_audio_s > 0


def test_run_command_runs_the_demo_offline(tmp_path):
    """The README's run command (set-up + `voice-agent demo`), with no network to the hub."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VOICE_AGENT_CACHE": str(tmp_path / "va"),
           "QWEN3_TTS_CACHE": str(tmp_path / "q3")}  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "reply.wav"
    p = subprocess.run(["bash", str(root / "scripts" / "run.sh"), "--json", "--out", str(out),
                        "--tts-port", str(free_port()), "--llm-port", str(free_port())],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout)
    (turn,) = report["turns"]
    assert "time" in turn["transcript"].lower()
    assert any("RANDOM" in n for n in report["notes"])
    assert out.is_file()
    # the random tiny LLM's reply is random bytes: what the agent's text transforms leave of it
    # is voiced, and a reply they leave nothing speakable of is a silent turn (not an error)
    if asyncio.run(_speakable(turn["reply_text"])):
        assert turn["voice_to_voice_s"] is not None and not turn["silent"], turn
    else:
        assert turn["silent"] and turn["voice_to_voice_s"] is None, turn


async def _speakable(text: str) -> bool:
    """Whether the agent would send any of `text` to the TTS (its transforms, the engine's rule)."""
    from livekit.agents.voice.transcription.text_transforms import _apply_text_transforms

    from livekit.plugins.qwen3_tts.protocol import has_speakable_text
    from voice_agent.text_filters import TTS_TEXT_TRANSFORMS

    async def one():
        yield text

    left = "".join([c async for c in _apply_text_transforms(one(), TTS_TEXT_TRANSFORMS)])
    return has_speakable_text(left)


async def test_a_reply_of_only_zero_width_characters_is_silence(engine):
    """An LLM reply of zero-width and control characters only: nothing to say, so nothing is
    sent to the TTS (voice_agent.text_filters), no error, and the turn ends. LiveKit's own check
    keeps such characters and its TTS failed with "no audio frames were pushed"."""
    llm = await ScriptedChatServer("\u200b\u200d\ufeff\u2060\x07", use_tool=False).start()
    settings = _settings(engine, llm.url)
    try:
        report, = await run_turns(settings, [_question("Are you there?")], tts_url=settings.tts_url,
                                  llm_url=llm.url, turn_timeout=180)  # fmt: skip
    finally:
        await llm.stop()
    assert report.errors == [] and report.reply_audio_s == 0, report
    assert "there" in report.transcript.lower() and len(llm.requests) == 1
