"""The voice pipeline: Silero VAD → faster-whisper → LLM → Qwen3-TTS, as a LiveKit AgentSession.

`build_session` assembles the components from Settings; `VoiceAgent` is the agent itself (its
instructions, one example tool, and a spoken apology when the LLM fails).
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import AsyncIterable

import httpx
from livekit.agents import (
    Agent,
    AgentSession,
    APIConnectOptions,
    ModelSettings,
    function_tool,
    llm,
)
from livekit.agents.voice.agent_session import SessionConnectOptions

from .observability import APOLOGIES
from .settings import Settings

logger = logging.getLogger("voice_agent")
APOLOGY = "Sorry, I can't think right now. Please try again in a moment."


class VoiceAgent(Agent):
    def __init__(self, instructions: str) -> None:
        super().__init__(instructions=instructions)
        self.tool_calls: list[str] = []

    @function_tool
    async def get_current_time(self) -> str:
        """Tell the current local time, when the user asks what time it is."""
        self.tool_calls.append("get_current_time")
        return _dt.datetime.now().strftime("It is %H:%M.")

    async def llm_node(
        self, chat_ctx: llm.ChatContext, tools: list[llm.Tool], model_settings: ModelSettings
    ) -> AsyncIterable[llm.ChatChunk | str]:
        """The default LLM node; if the LLM fails before saying anything, speak an apology."""
        said = False
        try:
            async for chunk in Agent.default.llm_node(self, chat_ctx, tools, model_settings):
                said = True
                yield chunk
        except Exception as e:  # APIConnectionError, APIStatusError, timeouts...
            logger.error("LLM failed (%s: %s); speaking an apology", type(e).__name__, e)
            if not said:
                APOLOGIES.inc()
                yield APOLOGY


def build_stt(settings: Settings):
    from livekit.plugins import faster_whisper

    model = "bundled" if settings.offline and settings.stt_model in ("base.en", "tiny.en") else settings.stt_model
    return faster_whisper.STT(model=model, language=settings.stt_language)


def build_llm(settings: Settings, base_url: str):
    from livekit.plugins import openai

    return openai.LLM(
        model=settings.llm_model, base_url=base_url, api_key=settings.llm_api_key,
        max_completion_tokens=settings.llm_max_tokens,
        **({"temperature": settings.llm_temperature} if settings.llm_temperature is not None else {}),
        timeout=httpx.Timeout(settings.llm_timeout, connect=10.0),
    )  # fmt: skip


def build_tts(settings: Settings, url: str):
    from livekit.plugins import qwen3_tts

    return qwen3_tts.TTS(
        base_url=url, voice=settings.tts_voice, language=settings.tts_language,
        protocol=settings.tts_protocol, max_new_tokens=settings.tts_max_new_tokens,
    )  # fmt: skip


def build_session(settings: Settings, *, tts_url: str, llm_url: str, vad=None, stt=None,
                  echo_free: bool = False) -> AgentSession:  # fmt: skip
    """An AgentSession with VAD turn detection and barge-in (interruptions on).

    LiveKit ignores interruptions for the first 3 s of agent speech while echo cancellation warms
    up; `echo_free` (captured audio, no speaker feeding a microphone) turns that off.
    """
    extra = {"aec_warmup_duration": None} if echo_free else {}
    from livekit.plugins import silero

    return AgentSession(
        vad=vad or silero.VAD.load(),
        stt=stt or build_stt(settings),
        llm=build_llm(settings, llm_url),
        tts=build_tts(settings, tts_url),
        turn_handling={
            "turn_detection": "vad",
            "interruption": {"enabled": True, "mode": "vad", "min_duration": 0.3,
                             "resume_false_interruption": False},
            "preemptive_generation": {"enabled": False},
        },  # fmt: skip
        user_away_timeout=None,
        # LiveKit's default TTS timeout (10 s) would count a busy shared engine's queue as a stall
        conn_options=SessionConnectOptions(
            tts_conn_options=APIConnectOptions(timeout=settings.tts_timeout)),
        **extra,
    )
