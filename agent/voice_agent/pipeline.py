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
from livekit.plugins import faster_whisper, qwen3_tts, silero

from voice_agent.observability import APOLOGIES, TTS_FINISHES
from voice_agent.services.registry import cache_dir
from voice_agent.settings import Settings
from voice_agent.standby import StandbyTTS
from voice_agent.telephony import PHONE_SAMPLE_RATE
from voice_agent.text_filters import TTS_TEXT_TRANSFORMS
from voice_agent.turn_rules import RuleTurnDetector

logger = logging.getLogger("voice_agent")
APOLOGY = "Sorry, I can't think right now. Please try again in a moment."


class VoiceAgent(Agent):
    def __init__(self, instructions: str, tools: list | None = None,
                 chat_ctx: llm.ChatContext | None = None) -> None:  # fmt: skip
        super().__init__(instructions=instructions, tools=tools or [], chat_ctx=chat_ctx)
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

    model = (
        "bundled"
        if settings.offline and settings.stt_model in ("base.en", "tiny.en")
        else settings.stt_model
    )
    return faster_whisper.STT(model=model, language=settings.stt_language, streaming=settings.stt_streaming,
                              encoder_context=settings.stt_encoder_context,
                              final_after_silence=settings.stt_final_silence)  # fmt: skip


def build_llm(settings: Settings, base_url: str):
    # where a session is built (a job process, the demo): the worker's main process imports this
    # module but never builds a pipeline, and openai takes ~1 s to import (CLI start-up time)
    from livekit.plugins import openai

    return openai.LLM(
        model=settings.llm_model, base_url=base_url, api_key=settings.llm_api_key,
        max_completion_tokens=settings.llm_max_tokens,
        **({"temperature": settings.llm_temperature} if settings.llm_temperature is not None else {}),
        timeout=httpx.Timeout(settings.llm_timeout, connect=10.0),
    )  # fmt: skip


def build_tts(settings: Settings, url: str, *, phone: bool = False):
    """Qwen3-TTS; `phone`: asking the engine for phone-rate audio (PHONE_SAMPLE_RATE) where the
    engine's protocol has the field (qwen3-tts; vLLM-Omni sends 24 kHz, LiveKit resamples)."""
    rate = (
        PHONE_SAMPLE_RATE
        if phone and settings.tts_protocol == "qwen3-tts"
        else qwen3_tts.SAMPLE_RATE
    )
    return qwen3_tts.TTS(
        base_url=url, voice=settings.tts_voice, language=settings.tts_language,
        protocol=settings.tts_protocol, max_new_tokens=settings.tts_max_new_tokens,
        first_clause_min_words=settings.tts_first_clause_words,
        first_clause_chunk_frames=settings.tts_first_clause_chunk_frames,
        text_input=settings.tts_text_input, sample_rate=rate,
    )  # fmt: skip


def with_standby(settings: Settings, speaker: qwen3_tts.TTS):
    """The TTS the session speaks through: `speaker` (each utterance's finish reason counted in
    /metrics), wrapped so that no reply is dead air while no engine can speak (`standby.py`;
    TTS_HOLD_AFTER=0: unwrapped)."""
    speaker.on("finish_reason", lambda ending: TTS_FINISHES.labels(ending.reason).inc())
    if not settings.tts_hold_after:
        return speaker
    key = "|".join(map(str, (settings.tts_model, settings.tts_variant, settings.tts_voice,
                             settings.tts_language)))  # fmt: skip
    return StandbyTTS(speaker, key=key, hold_after=settings.tts_hold_after,
                      give_up_after=settings.tts_give_up_after, cache_dir=cache_dir())  # fmt: skip


def build_vad(settings: Settings, *, phone: bool = False):
    """Silero VAD; `phone`: with the settings for phone callers (PHONE_VAD_*)."""
    if phone:
        return silero.VAD.load(min_silence_duration=settings.phone_vad_min_silence,
                               activation_threshold=settings.phone_vad_activation)  # fmt: skip
    return silero.VAD.load(min_silence_duration=settings.vad_min_silence)


def build_turn_detector(settings: Settings):
    """The end-of-turn check LiveKit asks after the VAD's end of speech ("vad": none)."""
    if settings.turn_detector == "rule":
        return RuleTurnDetector()
    if settings.turn_detector == "livekit":
        try:  # optional extra: livekit-plugins-turn-detector
            from livekit.plugins.turn_detector.multilingual import MultilingualModel
        except ImportError as e:
            raise RuntimeError("TURN_DETECTOR=livekit needs livekit-plugins-turn-detector (uv pip "
                               "install livekit-plugins-turn-detector) and its model files "
                               "(voice-agent download-files)") from e  # fmt: skip
        return MultilingualModel()
    return "vad"


def build_session(settings: Settings, *, tts_url: str, llm_url: str, vad=None, stt=None,
                  echo_free: bool = False, phone: bool = False) -> AgentSession:  # fmt: skip
    """An AgentSession with VAD turn detection, an end-of-turn check on the transcript
    (TURN_DETECTOR), LiveKit's endpointing delays, preemptive generation and barge-in.

    LiveKit ignores interruptions for the first 3 s of agent speech while echo cancellation warms
    up; `echo_free` (captured audio, no speaker feeding a microphone) turns that off. `phone`:
    a caller of kind SIP (the TTS asks for phone-rate audio, `build_tts`).
    """
    extra = {"aec_warmup_duration": None} if echo_free else {}
    return AgentSession(
        vad=vad or build_vad(settings),
        stt=stt or build_stt(settings),
        llm=build_llm(settings, llm_url),
        tts=with_standby(settings, build_tts(settings, tts_url, phone=phone)),
        turn_handling={
            "turn_detection": build_turn_detector(settings),
            "endpointing": {
                "mode": "fixed",
                "min_delay": settings.endpointing_min_delay,
                "max_delay": settings.endpointing_max_delay,
            },
            "interruption": {
                "enabled": True,
                "mode": "vad",
                "min_duration": 0.3,
                "resume_false_interruption": False,
            },
            "preemptive_generation": {
                "enabled": settings.preemptive_generation,
                "preemptive_tts": settings.preemptive_tts,
            },
        },  # fmt: skip
        user_away_timeout=None,
        tts_text_transforms=TTS_TEXT_TRANSFORMS,  # LiveKit's, and zero-width/control characters out
        # LiveKit's default timeouts (10 s) would count a busy shared engine's queue, or a local
        # whisper pass on a loaded CPU, as a stall
        conn_options=SessionConnectOptions(
            tts_conn_options=APIConnectOptions(timeout=settings.tts_timeout),
            stt_conn_options=APIConnectOptions(timeout=settings.stt_timeout),
        ),
        **extra,
    )
