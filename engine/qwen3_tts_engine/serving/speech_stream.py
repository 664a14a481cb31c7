"""`GET /v1/audio/speech/stream`: utterances whose text arrives while they are spoken, one after
another on one WebSocket (the engine's own protocol; the session core is `socket_session.py`).

Subprotocol `qwen3-tts.speech.v1`. For each utterance the client sends `session.start` (the
fields of `POST /v1/audio/speech`), then `input_text.append` pieces and `input_text.end` (or
`response.cancel`); the server answers `session.created` (the utterance's id and `sample_rate`:
the start's, 24 kHz by default), `input_text.ack`, binary PCM chunks (s16le mono at that rate),
`response.first_audio` after the first chunk and `response.done`. The socket then stays open for
the next `session.start` (closed by the server, 1000, after `ws_keepalive_timeout_s` without
one). An `error` event carries the status and body the same error gets on POST, and the server
closes (1008 for a client error, 1011 for the server's). Closing the socket before
`input_text.end` cancels the utterance. The synthesis starts with the first text and runs as on
POST (`Engine.stream`); its text goes to the worker as it comes (`dispatch/text_input.py`).
"""

from __future__ import annotations

from aiohttp import web

from qwen3_tts_engine.protocol import SPEECH_STREAM_SUBPROTOCOL, RequestError
from qwen3_tts_engine.serving.errors import RETRY_STATUSES
from qwen3_tts_engine.serving.session_core import Command, allowed
from qwen3_tts_engine.serving.socket_session import SocketHub, SocketSession, Utterance

SUBPROTOCOL = SPEECH_STREAM_SUBPROTOCOL
MAX_START_FIELDS = 64  # a session.start names at most this many fields (POST's are ~30)


def error_event(error: RequestError, retry_after_s: int | None = None) -> dict:
    """The `error` event: the status and the body POST /v1/audio/speech answers with."""
    event = {"type": "error", "status": error.status, **error.to_json()}
    if retry_after_s and error.status in RETRY_STATUSES:
        event["retry_after_s"] = retry_after_s
    return event


class SpeechStreamRoutes:
    """The engine's own streaming-text protocol over the shared socket hub."""

    def __init__(self, hub: SocketHub) -> None:
        self.hub = hub

    def offered(self, request: web.Request) -> bool:
        """Whether the upgrade offers this protocol's subprotocol (the route is shared with
        vLLM-Omni's dialect, `vllm_omni_stream.py`: app.py picks by this)."""
        offered = request.headers.get("Sec-WebSocket-Protocol", "")
        return SUBPROTOCOL in (p.strip() for p in offered.split(","))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        return await self.hub.serve(request, SpeechStreamSession, (SUBPROTOCOL,), "speech_stream")


class SpeechStreamSession(SocketSession):
    """`session.start` / `input_text.*` / `response.cancel` over the session core."""

    async def handle(self, body: dict) -> None:
        kind = body["type"]
        utt = self.utterance
        if kind == "session.start":
            if not allowed(utt.state if utt else None, Command.CONFIGURE):
                raise RequestError("the session has started already: the next session.start "
                                   "comes after this utterance's response.done")  # fmt: skip
            if len(body) > MAX_START_FIELDS:
                raise RequestError(
                    f"session.start has {len(body)} fields; at most {MAX_START_FIELDS}"
                )
            await self._start({k: v for k, v in body.items() if k != "type"})
        elif kind not in ("input_text.append", "input_text.end", "response.cancel"):
            raise RequestError(f"unknown message type {kind!r}")
        elif utt is None:
            raise RequestError(f"{kind!r} before session.start")
        elif utt.settled:
            self._after_done(kind, body)
        elif kind == "input_text.append":
            self.append(body.get("text"))
            if utt.text.tokens != utt.acked_tokens:  # acks only when the committed tokens grew
                utt.acked_tokens = utt.text.tokens
                await self.send_json({"type": "input_text.ack", "chars": utt.text.chars,
                                      "tokens": utt.text.tokens})  # fmt: skip
        elif kind == "input_text.end":
            self.end_text()
        elif await self.cancel():  # response.cancel
            await self.send_json({"type": "response.done", "cancelled": True, **utt.counts()})

    def _after_done(self, kind: str, body: dict) -> None:
        """A message for an utterance that is over. What was in flight when it ended early (its
        frame cap, or a cancel while its text was still coming) is checked and dropped: the
        rest of its text, its end, a second cancel. Text after its own end is an error."""
        text = self.utterance.text
        if kind == "input_text.append":
            self.check_piece(body.get("text"))
            if text.ended:
                raise RequestError("input_text.append after input_text.end")
        elif kind == "input_text.end":
            text.end()

    async def _start(self, fields: dict) -> None:
        await self.open_utterance(fields)

    async def send_started(self, utt: Utterance) -> None:
        await self.send_json({"type": "session.created", "id": utt.rid, "sample_rate": utt.req.sample_rate,
                              "variant": str(utt.req.variant or self.service.engine.active.variant)})  # fmt: skip

    def error_event(self, error: RequestError) -> dict:
        return error_event(error, self.config.retry_after_s)

    async def send_audio(self, utt: Utterance, pcm: bytes) -> None:
        await self.send_bounded(pcm)

    async def send_first_audio(self, utt: Utterance, ms: float) -> None:
        await self.send_json({"type": "response.first_audio", "ms": round(ms, 1)})

    async def send_done(self, utt: Utterance) -> None:
        # the variant that served (session.created named the active one at the start: a swap in
        # between moves a request that had not started to the new one)
        await self.send_json(
            {"type": "response.done", **utt.counts(), "variant": utt.result.variant}
        )
