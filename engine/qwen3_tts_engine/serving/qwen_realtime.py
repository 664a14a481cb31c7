"""`GET /api-ws/v1/realtime`: the hosted Qwen3-TTS realtime protocol (Alibaba Model Studio's
"qwen-tts-realtime"), so that its clients change only the base URL; on the session core.

The client's events (`session.update`, `input_text_buffer.append` / `.commit` / `.clear`,
`session.finish`, and the SDK's `response.cancel`) become utterances of the core, one response
each, one at a time; the server's are the hosted service's (`session.created`, ...,
`response.audio.delta` with base64 PCM, ..., `session.finished`), each with an `event_id`.
docs/engine-api.md lists the fields honoured and those accepted and ignored, and the rule by
which `server_commit` mode cuts the text into responses (`sentence_parts`); the responses waiting
are the core's `Backlog` (at most `ws_max_pending`: past it sentences join the last one).
"""

from __future__ import annotations

import base64
import itertools
import json
from dataclasses import dataclass

from aiohttp import web

from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import QWEN_REALTIME_PATH, RequestError, check_length
from qwen3_tts_engine.serving.errors import RETRY_STATUSES
from qwen3_tts_engine.serving.session_core import Backlog, split_parts
from qwen3_tts_engine.serving.socket_session import SocketHub, SocketSession, Utterance

MODES = ("server_commit", "commit")
# session.update's fields the engine honours -> the POST field each becomes (`seed` is the
# engine's own: the hosted service has none)
SESSION_FIELDS = {"voice": "voice", "language_type": "language", "instructions": "instructions",
                  "sample_rate": "sample_rate", "response_format": "response_format",
                  "seed": "seed"}  # fmt: skip
# accepted and ignored: the hosted service's voice controls this model does not have
IGNORED_FIELDS = ("speech_rate", "volume", "pitch_rate", "bit_rate", "enable_tn",
                  "optimize_instructions")  # fmt: skip
MAX_SESSION_FIELDS = 64
# an incomplete response's reason (the Realtime API's words) by the engine's finish_reason
INCOMPLETE = {"length": "max_output_tokens", "repetition": "repetition"}

# (PCM as base64 in JSON: the flow control's bytes per byte of audio)
BASE64_RATIO = 4 / 3


def sentence_parts(piece: str) -> list[tuple[str, bool]]:
    """`piece` cut after each sentence end (the core's rule, `session_core.split_parts`):
    [(part, whether it ends a sentence)]; commit mode leaves the cutting to the client."""
    return split_parts(piece, "sentence")


@dataclass
class Text:
    """One response's text in the backlog."""

    text: TextInput


class QwenRealtimeRoutes:
    def __init__(self, hub: SocketHub) -> None:
        self.hub = hub

    def routes(self) -> list[web.RouteDef]:
        return [web.get(QWEN_REALTIME_PATH, self.realtime)]

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        return await self.hub.serve(request, QwenRealtimeSession, (), "qwen_realtime")


class QwenRealtimeSession(SocketSession):
    """One hosted-protocol session: its settings, its text buffer, its responses in turn."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.model = self.request.query.get("model") or self.service.engine.model
        self.mode = "server_commit"
        self.settings: dict = {"response_format": "pcm"}  # as the client named them
        self.buffer = ""  # commit mode: appended, not committed yet
        # texts committed (server_commit: also the one still growing, `backlog.open`) that no
        # response took yet
        self.backlog: Backlog[Text] = Backlog(self.limits.max_pending, self.config.limits)
        self.finishing = False  # session.finish came: speak what is left, then session.finished
        self._ids = itertools.count(1)
        self._client_event: str | None = None

    wire_ratio = BASE64_RATIO

    def text_open(self) -> bool:
        return bool(self.buffer) or self.backlog.open is not None or super().text_open()

    def _event(self, kind: str, **fields) -> dict:
        return {"event_id": f"event_{self.rid}_{next(self._ids)}", "type": kind, **fields}

    def _session(self) -> dict:
        return {"id": f"sess_{self.rid}", "object": "realtime.session", "model": self.model,
                "mode": self.mode, "voice": self.settings.get("voice"),
                "language_type": self.settings.get("language_type", "Auto"),
                "response_format": "pcm", "sample_rate": self.settings.get("sample_rate", 24000)}  # fmt: skip

    def _fields(self, settings: dict | None = None) -> dict:
        """The POST fields each response is made from (of `settings`, the session's by default)."""
        settings = self.settings if settings is None else settings
        return {SESSION_FIELDS[k]: v for k, v in settings.items() if k in SESSION_FIELDS}

    async def on_open(self) -> None:
        await self.send_json(self._event("session.created", session=self._session()))

    # -- client events -----------------------------------------------------------------------

    async def handle(self, body: dict) -> None:
        kind = body["type"]
        event_id = body.get("event_id")
        self._client_event = event_id[:64] if isinstance(event_id, str) else None
        if kind == "session.update":
            await self._update(body.get("session"))
        elif kind == "input_text_buffer.append":
            await self._append(body.get("text"))
        elif kind == "input_text_buffer.commit":
            await self._commit()
        elif kind == "input_text_buffer.clear":
            await self._clear()
        elif kind == "session.finish":
            await self._finish()
        elif kind == "response.cancel":
            await self._cancel()
        else:
            raise RequestError(f"unknown event type {kind!r}", param="type")

    async def _update(self, session: object) -> None:
        if session is None:
            session = {}
        if not isinstance(session, dict):
            raise RequestError("session is a JSON object", param="session")
        if len(session) > MAX_SESSION_FIELDS:
            raise RequestError(f"session has {len(session)} fields; at most {MAX_SESSION_FIELDS}",
                               param="session")  # fmt: skip
        if self.finishing:
            raise RequestError("session.update after session.finish", param="session")
        mode = session.get("mode", self.mode)
        if mode not in MODES:
            raise RequestError(f"mode must be one of {', '.join(MODES)}", param="session.mode")
        settings = {**self.settings, **{k: v for k, v in session.items() if k in SESSION_FIELDS}}
        try:  # each response is prepared again as it starts; a bad field is refused now
            self.service.prepare(self._fields(settings), streamed=True)
        except RequestError as e:
            theirs = {v: k for k, v in SESSION_FIELDS.items()}.get(e.param or "", e.param)
            raise RequestError(e.message, param=theirs and f"session.{theirs}", status=e.status,
                               code=e.code) from None  # fmt: skip
        self.settings = settings
        if mode != self.mode:  # to commit mode: what grew is committed
            self.backlog.close_open()
        self.mode = mode
        await self.send_json(self._event("session.updated", session=self._session()))
        await self._next()

    async def _append(self, text: object) -> None:
        # each piece, as it comes (the worker's tokenizer never sees a bad one; a message holds
        # no more text than one response may)
        text = self.check_piece(text)
        if self.finishing:
            raise RequestError("input_text_buffer.append after session.finish")
        if self.mode == "commit":
            check_length(len(self.buffer) + len(text), self.config.limits)
            self.buffer += text
            return
        for part, ends in sentence_parts(text):
            self.backlog.add(part, ends, lambda: Text(TextInput()))
        await self._next()

    async def _commit(self) -> None:
        if self.mode == "commit":
            if not self.buffer:
                # not fatal: the hosted service answers an error event and goes on
                await self.send_json(
                    self.error_event(RequestError("the input text buffer is empty"))
                )
                return
            self.backlog.push(Text(TextInput(self.buffer)))
            self.buffer = ""
        else:  # server_commit: at once (nothing left: nothing to do)
            self.backlog.close_open()
        await self.send_json(self._event("input_text_buffer.committed",
                                         item_id=f"item_{self.rid}_{self.started + self.backlog.waiting}"))  # fmt: skip
        await self._next()

    async def _clear(self) -> None:
        """Text no response has taken is dropped; a response speaking has its text ended."""
        self.buffer = ""
        open_ = self.backlog.open
        self.backlog.clear()
        utt = self.utterance
        if open_ is not None and utt is not None and utt.text is open_.text:
            self.end_text()
        await self.send_json(self._event("input_text_buffer.cleared"))

    async def _finish(self) -> None:
        if self.mode == "commit" and self.buffer:
            await self._commit()
        self.backlog.close_open()
        self.finishing = True
        await self._next()

    async def _cancel(self) -> None:
        """The SDK's `cancel_response`: the response speaking stops, the text waiting goes."""
        self.backlog.clear()
        utt = self.utterance
        if await self.cancel():
            await self._send_end(utt, "cancelled")
        await self._next()

    async def _next(self) -> None:
        """With no response speaking: start the next one, or end a finished session."""
        utt = self.utterance
        if utt is not None and not utt.settled:
            return
        if (item := self.backlog.pop()) is not None:
            await self.open_utterance(self._fields(), item.text)
        elif self.finishing and not self.closing:
            await self.send_json(self._event("session.finished"))
            self.closing = True  # `run` closes with 1000

    async def after_utterance(self, utt: Utterance) -> None:
        await self._next()

    async def send_started(self, utt: Utterance) -> None:
        rid, iid = f"resp_{utt.rid}", f"item_{utt.rid}"
        await self.send_json(
            self._event("response.created", response=self._response(utt, "in_progress"))
        )
        await self.send_json(self._event("response.output_item.added", response_id=rid, output_index=0,
                                         item=self._item(utt, "in_progress")))  # fmt: skip
        await self.send_json(self._event("response.content_part.added", response_id=rid, item_id=iid,
                                         output_index=0, content_index=0,
                                         part={"type": "audio", "text": ""}))  # fmt: skip

    # -- server events -----------------------------------------------------------------------

    def _response(self, utt: Utterance, status: str) -> dict:
        response = {"id": f"resp_{utt.rid}", "object": "realtime.response", "status": status,
                    "voice": utt.req.voice, "output": []}  # fmt: skip
        if status != "in_progress":
            response["output"] = [self._item(utt, "completed")]
            response["usage"] = {"characters": utt.text.chars}
            # the engine's own account (as its protocol's response.done)
            response["qwen3_tts"] = {**utt.counts(), "variant": utt.result.variant}
        if status != "in_progress":  # why it ended, in the engine's words too (finish_reason)
            reason = utt.finish_reason or "stop"
            response["status_details"] = {"type": status, "finish_reason": reason}
            if status == "incomplete":
                response["status_details"]["reason"] = INCOMPLETE.get(reason, reason)
            elif status == "cancelled":
                response["status_details"]["reason"] = "client_cancelled"
        return response

    def _item(self, utt: Utterance, status: str) -> dict:
        return {"id": f"item_{utt.rid}", "object": "realtime.item", "type": "message",
                "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [{"type": "audio"}]}  # fmt: skip

    async def send_audio(self, utt: Utterance, pcm: bytes) -> None:
        event = self._event("response.audio.delta", response_id=f"resp_{utt.rid}", item_id=f"item_{utt.rid}",
                            output_index=0, content_index=0, delta=base64.b64encode(pcm).decode())  # fmt: skip
        await self.send_bounded(json.dumps(event))

    async def send_done(self, utt: Utterance) -> None:
        await self._send_end(utt, "completed" if utt.finish_reason == "stop" else "incomplete")

    async def _send_end(self, utt: Utterance, status: str) -> None:
        ids = {"response_id": f"resp_{utt.rid}", "item_id": f"item_{utt.rid}"}
        where = {**ids, "output_index": 0, "content_index": 0}
        await self.send_json(self._event("response.audio.done", **where))
        await self.send_json(self._event("response.content_part.done", **where,
                                         part={"type": "audio", "text": ""}))  # fmt: skip
        await self.send_json(self._event("response.output_item.done", response_id=ids["response_id"],
                                         output_index=0, item=self._item(utt, "completed")))  # fmt: skip
        await self.send_json(self._event("response.done", response=self._response(utt, status)))

    def error_event(self, error: RequestError) -> dict:
        body = error.to_json()["error"]
        body["code"] = error.code or ("invalid_value" if error.status < 500 else "internal_error")
        body["status"] = error.status
        if self._client_event is not None:
            body["event_id"] = self._client_event  # the client's event it answers
        if self.config.retry_after_s and error.status in RETRY_STATUSES:
            body["retry_after_s"] = self.config.retry_after_s
        return self._event("error", error=body)
