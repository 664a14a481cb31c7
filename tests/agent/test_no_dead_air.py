"""No dead air, offline (an AgentSession without a room, real Silero, faster-whisper tiny.en, the
scripted LLM, the Qwen3-TTS plugin): with both TTS engines stopped, the reply's audio is the hold
phrase ("One moment, please.") and then the apology, sample for sample, instead of silence; in the
engine's voice when an engine was reached earlier (cached), else the bundled espeak-ng clips;
each counted in /metrics (`voice_agent_tts_standby_total`). The caller's side of a real LiveKit
call: tests/system/test_no_dead_air_call.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

from tests.support.speech_socket import engine_server
from voice_agent import standby
from voice_agent.harness.demo import load_turn_audio, run_turns
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.pipeline import build_tts, with_standby
from voice_agent.settings import Settings

pytestmark = pytest.mark.slow
ANSWER = "Hello there, I am here."


def _said(phrase: str, source: str) -> float:
    return REGISTRY.get_sample_value(
        "voice_agent_tts_standby_total", {"phrase": phrase, "source": source}
    )


@pytest.fixture
def isolated_cache(monkeypatch, tmp_path):
    """A cache folder of the test's own, and no phrases synthesized by an earlier test."""
    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path / "va"))
    monkeypatch.setattr(standby, "_SYNTHESIZED", {})


async def _reply_with_engines_down(settings: Settings) -> np.ndarray:
    llm = await ScriptedChatServer(ANSWER, use_tool=False).start()
    question = load_turn_audio(speech_wav("Are you there?", sample_rate=48000))
    try:
        (report,) = await run_turns(settings, [question], tts_url=settings.tts_url,
                                    llm_url=llm.url, turn_timeout=180)  # fmt: skip
    finally:
        await llm.stop()
    assert (
        report.reply_text.strip() == ANSWER and not report.errors
    )  # the turn itself went as usual
    return report.reply_audio


def _starts_with(audio: np.ndarray, *parts: bytes) -> None:
    at = 0
    for part in parts:
        expected = np.frombuffer(part, np.int16)
        assert len(expected) > 0
        assert np.array_equal(audio[at : at + len(expected)], expected), at
        at += len(expected)
    assert len(audio) - at <= 240  # at most LiveKit's 10 ms end-of-segment marker after them


async def test_the_engines_cached_phrases_cover_a_reply_while_both_engines_are_down(
    tiny_checkpoint, isolated_cache
):  # fmt: skip
    """The phrases are synthesized while an engine answers (as `prewarm()` does at a session's
    start); both engines stop; the next reply is the hold phrase, then the apology."""
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    stops = REGISTRY.get_sample_value("voice_agent_tts_finish_total", {"reason": "stop"})
    async with engine_server(model, 1) as a, engine_server(model, 1) as b:
        urls = f"http://127.0.0.1:{a.port},http://127.0.0.1:{b.port}"
        settings = Settings(tts_url=urls, llm_model="scripted", offline=True)
        speaker = with_standby(settings, build_tts(settings, urls))
        try:
            assert await speaker.cache_phrases()
        finally:
            await speaker.aclose()
    hold, source = speaker.phrases.get("hold")
    apology, _ = speaker.phrases.get("apology")
    assert source == "engine" and speaker.phrases.path("hold").exists()  # kept on disk too
    # each phrase's ending was counted in /metrics by the plugin's finish_reason event
    assert (
        REGISTRY.get_sample_value("voice_agent_tts_finish_total", {"reason": "stop"}) == stops + 2
    )
    before = _said("hold", "engine"), _said("apology", "engine")
    audio = await _reply_with_engines_down(settings)  # both stopped: nothing listens there now
    _starts_with(audio, hold, apology)
    assert (_said("hold", "engine"), _said("apology", "engine")) == (before[0] + 1, before[1] + 1)


async def test_the_bundled_clips_cover_a_reply_when_no_engine_was_ever_reached(isolated_cache):
    from tests.support.engine_process import free_port

    urls = f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}"  # nobody listens
    settings = Settings(tts_url=urls, llm_model="scripted", offline=True)
    before = _said("hold", "bundled"), _said("apology", "bundled")
    audio = await _reply_with_engines_down(settings)
    clips = [standby.read_wav(standby.BUNDLED / f"{n}.wav", 24000) for n in ("hold", "apology")]
    _starts_with(audio, *clips)
    assert (_said("hold", "bundled"), _said("apology", "bundled")) == (before[0] + 1, before[1] + 1)


async def test_the_bundled_clips_are_small_and_speak_the_phrases():
    """What scripts/make_standby_clips.sh wrote: under 100 KB together, and tiny.en hears the
    phrases in them."""
    from livekit import rtc

    from voice_agent.pipeline import build_stt

    paths = [standby.BUNDLED / f"{n}.wav" for n in ("hold", "apology")]
    assert sum(p.stat().st_size for p in paths) < 100_000
    stt = build_stt(Settings(offline=True))
    try:
        for path, words in zip(paths, (("one", "moment"), ("sorry", "again")), strict=True):
            pcm = standby.read_wav(path, 16000)
            event = await stt.recognize(rtc.AudioFrame(pcm, 16000, 1, len(pcm) // 2))
            text = event.alternatives[0].text.lower()
            assert all(w in text for w in words), text
    finally:
        await stt.aclose()
