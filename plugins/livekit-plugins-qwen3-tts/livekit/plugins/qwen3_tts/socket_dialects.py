"""The two socket dialects a streamed utterance may speak at `/v1/audio/speech/stream`: the
engine's own (subprotocol `qwen3-tts.speech.v1`: `session.start`, `input_text.append`,
`input_text.end`, `response.cancel`; `session.created`, `response.done`) and vLLM-Omni's (no
subprotocol: `session.config`, `input.text`, `input.done` (a flush: the socket stays open); per
sentence `audio.start` / PCM / `audio.done`, then `session.done` per flush; no cancel), which
vLLM-Omni and SGLang-Omni serve and the engine speaks too.

A dialect only translates: `text_socket.SocketAttempt` runs the utterance the same way on either,
and `failover.speak` moves it between endpoints of either (each endpoint's `protocol`). Each
event the server sends is read into a `Heard` the attempt acts on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .protocol import (
    EV_DONE,
    EV_FIRST_AUDIO,
    EV_SESSION_CREATED,
    MSG_TEXT_APPEND,
    MSG_TEXT_END,
    OMNI_AUDIO_DONE,
    OMNI_AUDIO_START,
    OMNI_INPUT_DONE,
    OMNI_INPUT_TEXT,
    OMNI_SESSION_DONE,
    SPEECH_STREAM_SUBPROTOCOL,
)


@dataclass
class Heard:
    """What one server event means for the utterance on the socket.

    kind: "begun" (its first event: the engine took it; `sample_rate`, `request_id`, `variant`
    where said), "first_audio" (the engine's timing), "sentence_done" (one sentence's end, its
    `finish_reason`), "done" (the utterance is over: `finish_reason`, `capped`), "error" (the
    event is the error), or "other" (nothing for this utterance: a late event of an earlier one)."""

    kind: str
    sample_rate: Any = None
    request_id: str | None = None
    variant: str | None = None
    finish_reason: str | None = None
    capped: bool = False
    ms: float | None = None


class Ours:
    """The engine's own dialect: one `session.start` per utterance; `response.cancel` stops one."""

    name = "qwen3-tts"
    subprotocols: tuple[str, ...] = (SPEECH_STREAM_SUBPROTOCOL,)
    can_cancel = True
    # the engine answers the start (session.created) before any text: a silence then is a stall
    owes_start = True

    def opening(self, starts: Mapping[str, dict], flushes: int) -> dict:
        return dict(starts[self.name])

    def piece(self, text: str) -> dict:
        return {"type": MSG_TEXT_APPEND, "text": text}

    def end(self) -> dict:
        return {"type": MSG_TEXT_END}

    def read(self, event: Mapping, begun: bool, flush: int) -> Heard:
        kind = event.get("type")
        if kind == EV_SESSION_CREATED:
            return Heard("begun", sample_rate=event.get("sample_rate"),
                         request_id=str(event.get("id") or ""), variant=event.get("variant"))  # fmt: skip
        if not begun:  # nothing of this utterance comes before session.created
            return Heard("other")
        if kind == EV_FIRST_AUDIO:
            return Heard("first_audio", ms=event.get("ms"))
        if kind == EV_DONE:
            return Heard("done", finish_reason=event.get("finish_reason"),
                         capped=event.get("capped") is True)  # fmt: skip
        return Heard("other")


class VllmOmni:
    """vLLM-Omni's dialect: `session.config` (sticky: sent with each utterance, for its seed),
    the text in `input.text` pieces, `input.done` ends it. Events carry the flush's index
    (`utterance_index`, counted per socket from 0): one of an earlier flush is not this one's."""

    name = "vllm-omni"
    subprotocols: tuple[str, ...] = ()
    can_cancel = False  # the dialect has no cancel: a barge-in closes the socket
    owes_start = False  # vLLM-Omni answers nothing before input.done (its text is buffered)

    def opening(self, starts: Mapping[str, dict], flushes: int) -> dict:
        return dict(starts[self.name])

    def piece(self, text: str) -> dict:
        return {"type": OMNI_INPUT_TEXT, "text": text}

    def end(self) -> dict:
        return {"type": OMNI_INPUT_DONE}

    def read(self, event: Mapping, begun: bool, flush: int) -> Heard:
        kind = event.get("type")
        index = event.get("utterance_index")
        if index is not None and index != flush:
            return Heard("other")
        if kind == OMNI_AUDIO_START:
            if begun:
                return Heard("other")  # a later sentence of the same flush
            return Heard("begun", sample_rate=event.get("sample_rate"),
                         request_id=f"{flush}.{event.get('sentence_index', 0)}")  # fmt: skip
        if kind == OMNI_AUDIO_DONE:
            return Heard("sentence_done", finish_reason=event.get("finish_reason"))
        if kind == OMNI_SESSION_DONE:
            return Heard("done", finish_reason=event.get("finish_reason"))
        return Heard("other")


DIALECTS = {d.name: d for d in (Ours(), VllmOmni())}
