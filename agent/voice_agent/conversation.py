"""Drive spoken turns through an AgentSession (no LiveKit room) and measure each turn.

Each turn plays a user's utterance into a paced microphone, waits for the agent's spoken reply,
and records transcript, reply, audio and LiveKit's per-turn metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from livekit.agents import AgentSession, llm
from livekit.agents.metrics import STTMetrics

from .audio_io import CaptureAudioOutput, PacedAudioInput


@dataclass
class TurnReport:
    transcript: str = ""
    reply_text: str = ""
    reply_audio_s: float = 0.0
    interrupted: bool = False
    end_of_turn_delay_s: float | None = None
    stt_s: float | None = None
    transcription_delay_s: float | None = None
    llm_ttft_s: float | None = None
    tts_ttfb_s: float | None = None
    e2e_latency_s: float | None = None  # LiveKit's: end of user speech -> agent audio out
    voice_to_voice_s: float | None = None  # ours: last user sample sent -> first agent sample
    tool_calls: list[str] = field(default_factory=list)
    reply_audio: np.ndarray | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("reply_audio")
        return d


class Conversation:
    """Wires paced audio in and captured audio out into `session` and runs turns."""

    def __init__(self, session: AgentSession, audio_in: PacedAudioInput, audio_out: CaptureAudioOutput):
        self.session = session
        self.audio_in = audio_in
        self.audio_out = audio_out
        self._items: asyncio.Queue[llm.ChatMessage] = asyncio.Queue()
        self._stt: list[float] = []
        self._calls: list[str] = []
        session.input.audio = audio_in
        session.output.audio = audio_out
        session.on("conversation_item_added", lambda ev: self._on_item(ev.item))
        session.on("metrics_collected", self._on_metrics)
        session.on("function_tools_executed", lambda ev: self._calls.extend(
            c.name for c in ev.function_calls))  # fmt: skip

    def _on_item(self, item) -> None:
        if isinstance(item, llm.ChatMessage):
            self._items.put_nowait(item)

    def _on_metrics(self, ev) -> None:
        if isinstance(ev.metrics, STTMetrics):
            self._stt.append(ev.metrics.duration)

    async def turn(self, speech: np.ndarray, *, timeout: float = 300.0) -> TurnReport:
        """Speak `speech` (int16 at the input's rate) and wait for the agent's reply."""
        report = TurnReport()
        self._stt.clear()
        self._calls.clear()
        t_sent = await self.audio_in.play(speech)
        deadline = time.perf_counter() + timeout
        while True:
            item = await asyncio.wait_for(self._items.get(), max(0.1, deadline - time.perf_counter()))
            m = item.metrics
            if item.role == "user":
                report.transcript = item.text_content or ""
                report.end_of_turn_delay_s = m.get("end_of_turn_delay")
                report.transcription_delay_s = m.get("transcription_delay")
            elif item.role == "assistant":
                report.reply_text = item.text_content or ""
                report.interrupted = item.interrupted
                report.llm_ttft_s = m.get("llm_node_ttft")
                report.tts_ttfb_s = m.get("tts_node_ttfb")
                report.e2e_latency_s = m.get("e2e_latency")
                break
        audio = self.audio_out.audio_since(t_sent)
        first = next((ts for ts, _ in self.audio_out.frames if ts >= t_sent), None)
        report.reply_audio = audio
        report.reply_audio_s = len(audio) / (self.audio_out.sample_rate or 24000)
        report.voice_to_voice_s = None if first is None else first - t_sent
        report.stt_s = sum(self._stt) if self._stt else None
        report.tool_calls = list(self._calls)
        return report
