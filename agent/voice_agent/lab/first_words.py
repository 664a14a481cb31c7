"""Where a reply's first words wait between the LLM and the listener, on one clock.

`voice-agent bench --llm-pace` runs the paced LLM stand-in, the engine and the agent in one
process, so one `time.perf_counter` dates every stage of a turn's reply (`STAGES`):
the stand-in writes its first token, the agent's `llm_node` gets it (LiveKit's OpenAI plugin),
LiveKit commits the user's turn (with preemptive generation the LLM starts at the final
transcript, but the TTS only once the reply is scheduled), the `tts_node` starts and gets its
first text (after LiveKit's text transforms), the plugin sends text to the engine (LiveKit's
`_mark_started`, stamped on the first frame), the first frame leaves the TTS stream (the engine's
first chunk, the socket, LiveKit's AudioEmitter), and the first frame reaches the audio output.
`TimedAgent` is the agent with stamps on its nodes; LiveKit's own nodes do the work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterable

from livekit.agents import Agent, ModelSettings, llm
from livekit.agents.types import USERDATA_TTS_STARTED_TIME

from voice_agent.pipeline import VoiceAgent

# (stage, what happened then), in the order the first words pass them
STAGES = (
    ("llm_first_token_sent", "the LLM stand-in wrote its first token"),
    ("llm_first_token", "the agent's llm_node got it"),
    ("turn_committed", "LiveKit committed the user's turn (the reply may start)"),
    ("tts_node_started", "the tts_node started"),
    ("tts_text_in", "its first text arrived (after LiveKit's text transforms)"),
    ("socket_text_sent", "the plugin sent text to the engine (LiveKit's _mark_started)"),
    ("tts_first_frame", "the first frame left the TTS stream"),
    ("first_audio_out", "the first frame reached the agent's audio output"),
)

# The breakdown's rows: (name, from stage, to stage). "reply_start" is the later of the LLM's
# first token and the commit: before the commit LiveKit holds the reply by design.
SPANS = (
    ("llm_transport", "llm_first_token_sent", "llm_first_token"),
    ("held_for_commit", "llm_first_token", "reply_start"),
    ("reply_start_to_tts_node", "reply_start", "tts_node_started"),
    ("tts_node_to_text_in", "tts_node_started", "tts_text_in"),
    ("text_in_to_socket", "tts_text_in", "socket_text_sent"),
    ("socket_to_first_frame", "socket_text_sent", "tts_first_frame"),
    ("first_frame_to_output", "tts_first_frame", "first_audio_out"),
)


class ReplyClock:
    """One turn's stamps (perf_counter). The first stamp of a stage counts, but for the commit
    (the last user message: the reply answers it) and the LLM's generations (all kept: a
    preemptive one may be redone; the reply's is the last to start before the tts_node)."""

    def __init__(self) -> None:
        self.stamps: dict[str, float] = {}
        self.generations: list[tuple[float, float]] = []  # (llm_node started, its first text)
        self.tts_streams: list = []  # the plugin's SynthesizeStream(s) of the reply

    def mark(self, stage: str, t: float | None = None) -> None:
        self.stamps.setdefault(stage, time.perf_counter() if t is None else t)

    def committed(self) -> None:
        self.stamps["turn_committed"] = time.perf_counter()

    def reply_stamps(self, first_tokens_sent: list[float], first_audio_out: float | None) -> dict:
        """Every stage's time for the reply (None where it did not happen), and `reply_start`."""
        s = dict(self.stamps)
        if first_audio_out is not None:
            s["first_audio_out"] = first_audio_out
        tts_start = s.get("tts_node_started")
        gens = [g for g in self.generations if tts_start is None or g[0] <= tts_start]
        s["llm_first_token"] = gens[-1][1] if gens else None
        if s["llm_first_token"] is not None:
            sent = [t for t in first_tokens_sent if t <= s["llm_first_token"]]
            s["llm_first_token_sent"] = sent[-1] if sent else None
        known = [s.get("llm_first_token"), s.get("turn_committed")]
        s["reply_start"] = None if None in known else max(known)
        return {k: s.get(k) for k in [*(name for name, _ in STAGES), "reply_start"]}

    def engine_first_audio_s(self) -> float | None:
        """The engine's own `response.first_audio` (its socket: text in -> first chunk) of the
        reply's first streamed utterance; None on the sentence path."""
        for stream in self.tts_streams:
            for report in getattr(stream, "text_streams", []):
                if report.engine_first_audio_ms is not None:
                    return report.engine_first_audio_ms / 1000
        return None


def spans_ms(stamps: dict) -> dict:
    """The breakdown of one reply: each span in ms (None where a stage is missing)."""
    out = {}
    for name, a, b in SPANS:
        ta, tb = stamps.get(a), stamps.get(b)
        out[name] = None if ta is None or tb is None else (tb - ta) * 1000
    return out


def median_spans(rows: list[dict]) -> dict:
    """Per span, the median ms over the rows that have it."""
    out = {}
    for name, _, _ in SPANS:
        xs = [r[name] for r in rows if r.get(name) is not None]
        out[name] = statistics.median(xs) if xs else None
    return out


def _text_of(chunk) -> str:
    if isinstance(chunk, str):
        return chunk
    delta = getattr(chunk, "delta", None)
    return (delta.content or "") if delta is not None else ""


class TimedAgent(VoiceAgent):
    """VoiceAgent whose LLM and TTS nodes stamp `clock`; the work is LiveKit's default nodes'."""

    def __init__(self, instructions: str, clock: ReplyClock) -> None:
        super().__init__(instructions)
        self.clock = clock

    async def llm_node(
        self, chat_ctx: llm.ChatContext, tools: list[llm.Tool], model_settings: ModelSettings
    ) -> AsyncIterable[llm.ChatChunk | str]:
        started, first = time.perf_counter(), True
        async for chunk in super().llm_node(chat_ctx, tools, model_settings):
            if first and _text_of(chunk):
                first = False
                self.clock.generations.append((started, time.perf_counter()))
            yield chunk

    async def tts_node(self, text: AsyncIterable[str], model_settings: ModelSettings):
        clock = self.clock
        clock.mark("tts_node_started")

        async def stamped() -> AsyncIterable[str]:
            async for piece in text:
                if piece.strip():
                    clock.mark("tts_text_in")
                yield piece

        first = True
        async for frame in Agent.default.tts_node(self, stamped(), model_settings):
            if first:
                first = False
                clock.mark("tts_first_frame")
                if (sent := frame.userdata.get(USERDATA_TTS_STARTED_TIME)) is not None:
                    clock.mark("socket_text_sent", sent)
                tts = self.session.tts
                tts = getattr(tts, "inner", tts)  # the plugin under the agent's StandbyTTS
                clock.tts_streams = list(getattr(tts, "_streams", ()))  # the plugin's own
            yield frame
