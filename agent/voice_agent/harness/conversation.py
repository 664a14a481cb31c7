"""Drive spoken turns through an AgentSession (no LiveKit room) and measure each turn.

Each turn plays a user's utterance into a paced microphone, waits for the agent's spoken reply,
and records transcript, reply, audio and LiveKit's per-turn metrics. A component that fails for
good (LiveKit's unrecoverable error: retries spent, or a request the server refuses) ends the
turn at once with `TurnFailed`, carrying the server's message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from livekit.agents import AgentSession, APIError, llm
from livekit.agents.metrics import STTMetrics

from voice_agent.harness.audio_io import CaptureAudioOutput, PacedAudioInput

COMPONENTS = {"tts_error": "TTS", "stt_error": "STT", "llm_error": "LLM"}  # LiveKit's error types


HOLD_S = 3600.0  # LiveKit's endpointing delay while a turn is held open: longer than any hang guard


@dataclass
class InParts:
    """One utterance spoken in parts, with a wait between them that events end, not a clock.

    After each part but the last, the turn waits for the STT's final transcript of that part,
    then for `between(i)` (i: the part just spoken, from 0), while the microphone sends silence
    in real time: as long as the caller pauses, however long the machine takes to get there.
    LiveKit must not commit the turn during such a pause (its endpointing delay counts from
    the end of speech, so a slow STT or condition would end the turn before the caller goes
    on): from the first part until the last part's final transcript, both endpointing delays
    are `HOLD_S`. They are set back in LiveKit's own event for that transcript, which it emits
    before it starts the end-of-turn check on it, so the turn then ends after the session's
    usual delay from the end of the last part, with every part's words in it.
    """

    parts: list[np.ndarray]
    between: Callable[[int], Awaitable[object]]


class TurnFailed(RuntimeError):
    """A turn that cannot get its reply: the TTS, STT or LLM failed for good, or the session
    closed. The message is one line: which component, and what its server said."""


class _Silent:
    """The agent's reply ended without a word."""


_SILENT = _Silent()


@dataclass
class TurnReport:
    transcript: str = ""
    reply_text: str = ""
    reply_audio_s: float = 0.0
    interrupted: bool = False
    silent: bool = False  # the agent's reply had no text (nothing was said)
    user_messages: int = 0  # user turns LiveKit committed for this utterance (1 unless cut)
    early_commits: int = 0  # of them, committed before the utterance's last sample was sent
    end_of_turn_delay_s: float | None = None
    stt_s: float | None = None
    transcription_delay_s: float | None = None
    llm_ttft_s: float | None = None
    llm_ttfs_s: float | None = None  # LLM time to its first sentence (what the TTS waits for)
    tts_ttfb_s: float | None = None
    e2e_latency_s: float | None = None  # LiveKit's: end of user speech -> agent audio out
    voice_to_voice_s: float | None = None  # ours: last user sample sent -> first agent sample
    # LiveKit's end of speech (the VAD's: where end_of_turn_delay counts from) - the last sample sent
    vad_end_lag_s: float | None = None
    llm_requests: int = 0  # LLM requests that ended during the turn
    llm_wasted: int = 0  # of them, for a reply that was not the one spoken (preemptive, redone)
    tts_requests: int = 0  # likewise for the TTS
    tts_wasted: int = 0
    tool_calls: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # failures the agent answered anyway
    reply_audio: np.ndarray | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("reply_audio")
        return d


class Conversation:
    """Wires paced audio in and captured audio out into `session` and runs turns.

    `answers_llm_errors`: the agent speaks a reply of its own when the LLM fails (VoiceAgent's
    apology), so such a turn waits for that reply and lists the failure in `TurnReport.errors`.
    """

    def __init__(self, session: AgentSession, audio_in: PacedAudioInput,
                 audio_out: CaptureAudioOutput, *, answers_llm_errors: bool = False):  # fmt: skip
        self.session = session
        self.audio_in = audio_in
        self.audio_out = audio_out
        self.answers_llm_errors = answers_llm_errors
        self.failures: list[BaseException] = []  # the exceptions behind reported errors
        # (perf_counter when queued, item)
        self._items: asyncio.Queue[tuple[float, llm.ChatMessage | TurnFailed | _Silent]] = (
            asyncio.Queue()
        )
        self._errors: list[str] = []
        self._stt: list[float] = []
        self._calls: list[str] = []
        self._work: list = []  # LLM and TTS metrics: one per request
        session.input.audio = audio_in
        session.output.audio = audio_out
        session.on("conversation_item_added", lambda ev: self._on_item(ev.item))
        if session.stt is not None:  # the STT's own: the session's event is deprecated (warns)
            session.stt.on("metrics_collected", self._on_metrics)
        session.on("function_tools_executed", lambda ev: self._calls.extend(
            c.name for c in ev.function_calls))  # fmt: skip
        session.on("error", self._on_error)
        session.on("close", self._on_close)
        # what the session did during the current turn, for a turn that gets no reply
        self._trace: list[tuple[float, str]] = []
        session.on("user_state_changed", lambda ev: self._note(f"user {ev.new_state}"))
        session.on("agent_state_changed", lambda ev: self._note(f"agent {ev.new_state}"))
        session.on("user_input_transcribed", lambda ev: self._note(
            f"{'final' if ev.is_final else 'interim'} transcript {ev.transcript!r}"))  # fmt: skip
        session.on("speech_created", self._on_speech)
        for component in (session.llm, session.tts):
            if component is not None:
                component.on("metrics_collected", self._on_work)

    def _on_speech(self, ev) -> None:
        self._note(f"{ev.speech_handle.id} created ({ev.source})")
        ev.speech_handle.add_done_callback(self._on_speech_done)

    def _on_speech_done(self, handle) -> None:
        self._note(f"{handle.id} done{' (interrupted)' if handle.interrupted else ''}")
        said = any(
            isinstance(i, llm.ChatMessage) and i.role == "assistant" for i in handle.chat_items
        )
        if not handle.interrupted and not said:
            # LiveKit adds no message for a reply without text (an LLM that answered nothing):
            # the turn is over all the same
            self._put(_SILENT)

    def _put(self, item) -> None:
        self._items.put_nowait((time.perf_counter(), item))

    def _note(self, what: str) -> None:
        self._trace.append((time.perf_counter(), what))

    def _on_item(self, item) -> None:
        if isinstance(item, llm.ChatMessage):
            self._note(f"{item.role} message {(item.text_content or '')[:40]!r}")
            self._put(item)

    def _on_error(self, ev) -> None:
        error = ev.error
        what = COMPONENTS.get(getattr(error, "type", None))
        if what is None or error.recoverable:
            return  # LiveKit retries it (or falls back, for its interruption detector)
        message = f"the {what} failed: {error_message(error.error)}"
        self.failures.append(error.error)
        self._errors.append(message)
        if not (what == "LLM" and self.answers_llm_errors):
            self._put(TurnFailed(message))

    def _on_close(self, ev) -> None:
        cause = f": {error_message(ev.error.error)}" if ev.error is not None else ""
        self._put(TurnFailed(f"the agent session closed ({ev.reason.value}){cause}"))

    def _on_work(self, m) -> None:
        self._note(f"{m.type.removesuffix('_metrics').upper()} done")
        self._work.append(
            m
        )  # its speech_id is set by the agent activity's listener, maybe after this one

    def _on_metrics(self, metrics) -> None:
        if isinstance(metrics, STTMetrics):
            self._stt.append(metrics.duration)
            self._note(f"stt done ({metrics.audio_duration:.2f} s of audio)")

    async def turn(self, speech: np.ndarray | InParts, *, timeout: float = 300.0) -> TurnReport:
        """Speak `speech` (int16 at the input's rate, or `InParts`) and wait for the agent's reply."""
        report = TurnReport()
        self._stt.clear()
        self._calls.clear()
        self._work.clear()
        self._errors.clear()
        self._trace.clear()
        deadline = time.perf_counter() + timeout
        if isinstance(speech, InParts):
            t_sent = await self._play_in_parts(speech, timeout)
            deadline = time.perf_counter() + timeout  # the reply's own hang guard, after the pauses
        else:
            t_sent = await self.audio_in.play(speech)
        wall_offset = time.time() - time.perf_counter()  # LiveKit stamps with time.time()
        heard: list[str] = []
        while True:
            try:
                left = max(0.1, deadline - time.perf_counter())
                t, item = await asyncio.wait_for(self._items.get(), left)
            except TimeoutError:
                raise TimeoutError(
                    f"no reply from the agent within {timeout:g} s; {self.trace_since(t_sent)}"
                ) from None
            if isinstance(item, TurnFailed):
                raise item
            early = t < t_sent  # before the caller's last word: a turn committed too early
            if item is _SILENT:
                if early:
                    continue
                report.silent = True
                break
            m = item.metrics
            if item.role == "user":
                heard.append(item.text_content or "")
                report.early_commits += early
                # LiveKit's end-of-turn numbers, all from one message: it leaves them all out
                # of a message whose VAD anchor it finds unreliable (audio_recognition.py), as
                # can happen to the second message of a turn that came in two
                if (stopped := m.get("stopped_speaking_at")) is not None:
                    report.vad_end_lag_s = stopped - (t_sent + wall_offset)
                    report.end_of_turn_delay_s = m.get("end_of_turn_delay")
                    report.transcription_delay_s = m.get("transcription_delay")
            elif item.role == "assistant":
                if early:  # its reply to the part before the pause: not this turn's answer
                    continue
                report.reply_text = item.text_content or ""
                report.interrupted = item.interrupted
                report.llm_ttft_s = m.get("llm_node_ttft")
                report.llm_ttfs_s = m.get("llm_node_ttfs")
                report.tts_ttfb_s = m.get("tts_node_ttfb")
                report.e2e_latency_s = m.get("e2e_latency")
                break
        report.transcript = " ".join(t for t in heard if t)
        report.user_messages = len(heard)
        audio = self.audio_out.audio_since(t_sent)
        first = next((ts for ts, _ in self.audio_out.frames if ts >= t_sent), None)
        report.reply_audio = audio
        report.reply_audio_s = len(audio) / (self.audio_out.sample_rate or 24000)
        report.voice_to_voice_s = None if first is None else first - t_sent
        report.stt_s = sum(self._stt) if self._stt else None
        # LLM and TTS requests of the turn; wasted: those of another speech than the reply's (a
        # preemptive generation whose transcript changed). The reply's speech made the turn's
        # last LLM request (its audio has played by now).
        llm_work = [m for m in self._work if m.type == "llm_metrics"]
        tts_work = [m for m in self._work if m.type == "tts_metrics"]
        reply = llm_work[-1].speech_id if llm_work else None
        report.llm_requests, report.tts_requests = len(llm_work), len(tts_work)
        report.llm_wasted = sum(m.speech_id != reply for m in llm_work)
        report.tts_wasted = sum(m.speech_id != reply for m in tts_work)
        report.tool_calls = list(self._calls)
        report.errors = list(self._errors)
        return report

    async def _play_in_parts(self, speech: InParts, timeout: float) -> float:
        """Play the parts (see `InParts`); returns when the last one was sent. The turn stays
        held until the last part's final transcript (or this fails)."""
        session = self.session
        usual = {k: session.options.endpointing[k] for k in ("min_delay", "max_delay")}
        finals: asyncio.Queue[str] = asyncio.Queue()
        last_part = False
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                session.off("user_input_transcribed", on_transcribed)
                session.update_options(endpointing_opts=usual)

        def on_transcribed(ev) -> None:
            if not ev.is_final:
                return
            if last_part:
                # synchronous, inside LiveKit's emit: the end-of-turn check it starts next (for
                # this transcript) reads the usual delays and cancels the held ones
                release()
                self._note("turn released: the usual endpointing delays again")
            else:
                finals.put_nowait(ev.transcript)

        session.update_options(endpointing_opts={"min_delay": HOLD_S, "max_delay": HOLD_S})
        session.on("user_input_transcribed", on_transcribed)
        t_start = time.perf_counter()
        try:
            for i, part in enumerate(speech.parts):
                # a final from now on, with every earlier part's awaited, is the last part's
                last_part = i == len(speech.parts) - 1
                sent = await self.audio_in.play(part)
                if last_part:
                    return sent
                await self._wait(
                    finals.get(), t_start, timeout, f"the final transcript of part {i + 1}"
                )
                self._note(f"part {i + 1} transcribed")
                await self._wait(
                    speech.between(i), t_start, timeout, f"the wait after part {i + 1}"
                )
                self._note(f"part {i + 1}: the wait after it is over")
            raise ValueError("InParts with no parts")
        except BaseException:
            release()
            raise

    async def _wait(self, aw: Awaitable, t_start: float, timeout: float, what: str):
        """`aw`, or TimeoutError (a hang guard: `timeout` from `t_start`) with the turn's trace."""
        try:
            return await asyncio.wait_for(aw, max(0.1, t_start + timeout - time.perf_counter()))
        except TimeoutError:
            raise TimeoutError(f"{what} did not come within {timeout:g} s; "
                               f"{self.trace_since(t_start)}") from None  # fmt: skip

    def trace_since(self, t: float, last: int = 16) -> str:
        """One line: what the session did this turn (seconds from `t`), the last `last` events."""
        events = [f"{ts - t:+.2f} s {what}" for ts, what in self._trace][-last:]
        return "this turn (s from the end of the utterance): " + (
            "; ".join(events) or "nothing happened"
        )


def error_message(e: BaseException) -> str:
    """One line: an API error's message (the server's words), else the exception's name and text."""
    text = " ".join(str(e.message if isinstance(e, APIError) else e).split())
    return text if isinstance(e, APIError) and text else f"{type(e).__name__}: {text}".rstrip(": ")
