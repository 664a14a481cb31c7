"""`GET /v1/audio/speech/stream`: one utterance whose text arrives while it is spoken (WebSocket).

Subprotocol `qwen3-tts.speech.v1`. The client sends `session.start` (the fields of
`POST /v1/audio/speech`), then `input_text.append` pieces and `input_text.end` (or
`response.cancel`); the server answers `session.created` (with the `sample_rate`: the start's,
24 kHz by default), `input_text.ack`, binary PCM chunks (s16le mono at that rate),
`response.first_audio` after the first chunk and `response.done`, or an `error` event carrying
the status and body the same error gets on POST, then closes (1008 for a client error, 1011 for
the server's). Closing the socket before `input_text.end` cancels the
utterance. The synthesis starts with the first text (a session that waits for it holds no
stream and no slot) and runs as on POST (`Engine.stream`: auth, limits, the queue, a swap's hold and re-routing,
metrics, a trace span); its text goes to the worker as it comes (`dispatch/text_input.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time

from aiohttp import WSMsgType, web
from opentelemetry.trace import SpanKind, StatusCode

from qwen3_tts_engine.dispatch.handler import Result
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    ENGINE_FULL,
    HEADER_REQUEST_ID,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    RequestError,
    SpeechRequest,
    check_input,
    check_length,
    check_text,
)
from qwen3_tts_engine.serving.errors import MAPPED, RETRY_STATUSES, as_request_error, error_response
from qwen3_tts_engine.serving.speech_service import SpeechService, capped, decode_json
from qwen3_tts_engine.serving.tracing import extract_context, tracer

SUBPROTOCOL = SPEECH_STREAM_SUBPROTOCOL
CLOSE_CLIENT_ERROR, CLOSE_SERVER_ERROR = 1008, 1011
MAX_START_FIELDS = 64  # a session.start names at most this many fields (POST's are ~30)

_ids = itertools.count(1)


class ClientGone(Exception):
    """The client cannot take more: it closed, or stopped reading (its buffer is full)."""


class SessionEnd(Exception):
    """The session ends with this error event (a RequestError's status and body)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


def error_event(error: RequestError, retry_after_s: int | None = None) -> dict:
    """The `error` event: the status and the body POST /v1/audio/speech answers with."""
    event = {"type": "error", "status": error.status, **error.to_json()}
    if retry_after_s and error.status in RETRY_STATUSES:
        event["retry_after_s"] = retry_after_s
    return event


class SpeechStreamRoutes:
    """The streaming-text path of an `EngineServer`."""

    def __init__(self, service: SpeechService) -> None:
        self.service = service
        self.config = service.config
        self.metrics = service.metrics
        self.sessions: set[_Session] = set()  # open sockets

    def routes(self) -> list[web.RouteDef]:
        return [web.get(SPEECH_STREAM_PATH, self.stream)]

    def session_counts(self) -> tuple[int, int]:
        """(sessions open, those whose text has not begun: they hold no stream and no slot)."""
        return len(self.sessions), sum(1 for s in self.sessions if s.pump is None)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(HEADER_REQUEST_ID) or f"tts-ws-{next(_ids)}"
        config = self.config
        # writer_limit above the send bound: the bound (not aiohttp's drain) meets a stuck client
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), max_msg_size=config.max_body_bytes,
                                   writer_limit=2 * config.ws_send_buffer_bytes,
                                   heartbeat=config.ws_heartbeat_s or None,
                                   # no permessage-deflate: nothing a client sends is inflated
                                   # (PCM does not compress much either); pings are counted
                                   compress=False, autoping=False)  # fmt: skip
        if not ws.can_prepare(request).ok:
            return error_response(RequestError(f"{SPEECH_STREAM_PATH} takes a WebSocket upgrade "
                                               f"(subprotocol {SUBPROTOCOL})"))  # fmt: skip
        if len(self.sessions) >= config.max_sessions:  # before the upgrade: a plain 429
            self.metrics.requests.labels("429").inc()
            return error_response(RequestError(f"{len(self.sessions)} sessions are open (--max-sessions "
                                               f"{config.max_sessions})", status=429, code=ENGINE_FULL),
                                  retry_after_s=config.retry_after_s)  # fmt: skip
        with tracer.start_as_current_span("qwen3_tts.speech_stream", context=extract_context(request.headers),
                                          kind=SpanKind.SERVER,
                                          attributes={"qwen3_tts.request_id": rid}) as span:  # fmt: skip
            await ws.prepare(request)
            _bound_kernel_buffer(request, config.ws_send_buffer_bytes)
            session = _Session(self, ws, request, rid)
            self.sessions.add(session)
            try:
                await session.run()
            finally:  # also when aiohttp cancels the handler as the connection goes
                self.sessions.discard(session)
                self.metrics.requests.labels(session.outcome).inc()
                span.set_attribute("qwen3_tts.outcome", session.outcome)
                if session.error is not None:
                    span.set_status(StatusCode.ERROR, session.error.message)
        return ws


def _bound_kernel_buffer(request: web.Request, limit: int) -> None:
    """Cap the kernel's send buffer as well, so a client that stops reading fills both (the
    kernel's and the transport's) within `limit` bytes each, and is dropped then."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)


class _Session:
    """One socket: the reader (this task) and the synthesis pump (a task of its own)."""

    def __init__(self, routes: SpeechStreamRoutes, ws: web.WebSocketResponse, request: web.Request,
                 rid: str) -> None:  # fmt: skip
        self.service = routes.service
        self.config = routes.config
        self.ws = ws
        self.request = request
        self.send_bound = routes.config.ws_send_buffer_bytes  # this socket's, from its start
        self.rid = rid
        self.t0 = time.perf_counter()
        self.req: SpeechRequest | None = None
        self.ref_audio: bytes | None = None
        self.text: TextInput | None = None
        self.result = Result()
        self.pump: asyncio.Task | None = None
        self.error: RequestError | None = None
        self.outcome = "cancelled"  # for the requests metric: a status, "aborted" or "cancelled"
        self.chunks = 0
        self.samples = 0
        self.acked_tokens = -1
        self.messages = 0  # from the client, pings included (ws_max_messages)
        self.close_code, self.close_reason = 1000, b""  # what `run` closes the socket with
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        """Serve the socket to its end (`outcome` says how it ended)."""
        try:
            await self._read()
            # the client stopped sending: after input_text.end the utterance is finished (audio to
            # a client that closed finds it gone); before it, its end cancels the utterance
            if self.pump is not None and (self.pump.done() or self.text.ended):
                await self.pump
        except SessionEnd as e:
            await self._fail(e.error)
        except ClientGone as e:  # an ack found the client gone or stuck
            self._drop(e)
        finally:
            if self.pump is not None and not self.pump.done():
                # the client went away (or cancelled): the synthesis stops, its slot frees
                self.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self.pump
                logger.info(
                    "%s: socket closed after %d chunks; synthesis cancelled", self.rid, self.chunks
                )
            if not self.ws.closed:  # from this task, the only reader: a whole closing handshake
                await self.ws.close(code=self.close_code, message=self.close_reason)

    # -- client -> server --------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            timeout = self._read_timeout()
            try:
                message = await self._receive(timeout)
            except TimeoutError:
                raise SessionEnd(
                    RequestError(self._idle_reason(), status=408, code="idle_timeout")
                ) from None
            if message is None:  # the synthesis ended (done, failed or dropped)
                return
            if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return
            self.messages += 1
            if self.messages > self.config.ws_max_messages:
                raise SessionEnd(RequestError(f"more than {self.config.ws_max_messages} messages in "
                                              "one session (ws_max_messages)", status=429))  # fmt: skip
            if message.type == WSMsgType.PING:
                await self.ws.pong(message.data)
                continue
            if message.type == WSMsgType.PONG:  # the heartbeat's answer (aiohttp saw it)
                continue
            if message.type == WSMsgType.TEXT:
                try:
                    body = decode_json(message.data, "a message")  # as POST's body
                except RequestError as e:
                    raise SessionEnd(e) from None
            elif message.type == WSMsgType.BINARY:
                raise SessionEnd(RequestError("binary frames carry audio from the server only; "
                                              "send JSON text frames"))  # fmt: skip
            else:  # ERROR (e.g. a frame above the size limit): aiohttp closes the socket
                return
            if not isinstance(body, dict) or not isinstance(body.get("type"), str):
                raise SessionEnd(RequestError('a message is a JSON object with a "type"'))
            try:
                if await self._handle(body):
                    return
            except RequestError as e:
                raise SessionEnd(e) from None
            if self.pump is not None and self.pump.done():
                return  # the synthesis ended (or failed) while the client was writing

    async def _receive(self, timeout: float | None):
        """The client's next message, or None when the synthesis ends first. Only this task
        reads and closes the socket: aiohttp's close() from another task while a receive() waits
        cuts the connection right after its close frame, and the client's answer to it then
        fails (the client saw 1006 after a clean response.done)."""
        if self.pump is None:
            return await self.ws.receive(timeout=timeout)
        receive = asyncio.ensure_future(self.ws.receive(timeout=timeout))
        try:
            await asyncio.wait({receive, self.pump}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
        if receive.cancelled():
            return None
        return receive.result()  # (its TimeoutError too)

    def _read_timeout(self) -> float | None:
        """How long the next client message may take: the first text is due within
        ws_first_text_timeout_s of the upgrade, then each message within ws_idle_timeout_s
        while the text is open; after input_text.end the synthesis bounds the session."""
        config = self.config
        if self.text is None or self.text.chars == 0:
            left = config.ws_first_text_timeout_s - (time.perf_counter() - self.t0)
            return max(0.001, left)
        return None if self.text.ended else config.ws_idle_timeout_s

    def _idle_reason(self) -> str:
        config = self.config
        if self.text is None or self.text.chars == 0:
            return (f"no text within {config.ws_first_text_timeout_s:g} s of the session's start "
                    "(ws_first_text_timeout_s)")  # fmt: skip
        return f"no message for {config.ws_idle_timeout_s:g} s while the text is open (ws_idle_timeout_s)"

    async def _handle(self, body: dict) -> bool:
        """One client message; True when the session is over."""
        kind = body["type"]
        if kind == "session.start":
            if self.req is not None:
                raise SessionEnd(RequestError("the session has started already"))
            if len(body) > MAX_START_FIELDS:
                raise SessionEnd(RequestError(f"session.start has {len(body)} fields; at most "
                                              f"{MAX_START_FIELDS}"))  # fmt: skip
            await self._start({k: v for k, v in body.items() if k != "type"})
        elif self.req is None:
            raise SessionEnd(RequestError(f"{kind!r} before session.start"))
        elif kind == "input_text.append":
            await self._append(body.get("text"))
        elif kind == "input_text.end":
            if not self.text.ended:
                check_input(self.text.text, self.config.limits)  # as POST checks `input`
                self.text.end()
                self._begin()
        elif kind == "response.cancel":
            if self.pump is not None:
                self.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self.pump
            await self._send_json({"type": "response.done", "cancelled": True, **self._counts()})
            return True
        else:
            raise SessionEnd(RequestError(f"unknown message type {kind!r}"))
        return False

    async def _start(self, body: dict) -> None:
        try:
            req, ref = self.service.prepare(body, streamed=True)
        except RequestError as e:
            raise SessionEnd(e) from None
        self.text = TextInput(req.input)
        req.input = ""  # the text goes to the worker as it arrives
        self.req, self.ref_audio = req, ref
        await self._send_json({"type": "session.created", "id": self.rid, "sample_rate": req.sample_rate,
                               "variant": str(req.variant or self.service.engine.active.variant)})  # fmt: skip
        if self.text.chars:
            self._begin()

    def _begin(self) -> None:
        """Start the synthesis once there is text: until then the session holds no stream, no
        place in a queue and no real-time slot (`/load` counts it in sessions_waiting_for_text)."""
        if self.pump is None:
            chunks = self.service.stream(self.req, self.ref_audio, self.result, text=self.text)
            self.pump = asyncio.ensure_future(self._pump(chunks))

    async def _append(self, text) -> None:
        if not isinstance(text, str):
            raise SessionEnd(RequestError("input_text.append needs a string `text`", param="text"))
        check_text(text, "text")  # each piece, as it comes: the worker's tokenizer never sees it
        if self.text.ended:
            raise SessionEnd(RequestError("input_text.append after input_text.end"))
        check_length(
            self.text.chars + len(text), self.config.limits
        )  # over all pieces, as POST's `input`
        self.text.append(text)
        if text:
            self._begin()
        if self.text.tokens != self.acked_tokens:  # acks only when the committed tokens grew
            self.acked_tokens = self.text.tokens
            await self._send_json({"type": "input_text.ack", "chars": self.text.chars,
                                   "tokens": self.text.tokens})  # fmt: skip

    # -- server -> client --------------------------------------------------------------------

    async def _pump(self, chunks) -> str:
        """The synthesis: audio out as it is made, then `response.done`; the outcome."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await self._send_bytes(chunk.pcm)
                    self.service.observe_chunk(chunk, self.result)
                    self.chunks += 1
                    self.samples += len(chunk.pcm) // 2
                    if self.chunks == 1:
                        ms = (time.perf_counter() - self.t0) * 1000
                        await self._send_json({"type": "response.first_audio", "ms": round(ms, 1)})
            self.service.observe_done(self.result, self.rid, self.t0, self.chunks)
            # the variant that served (session.created named the active one at the start: a
            # swap in between moves a request that had not started to the new one)
            await self._send_json({"type": "response.done", **self._counts(),
                                   "variant": self.result.variant})  # fmt: skip
            self.outcome = "200"
        except MAPPED as e:
            return await self._fail(as_request_error(e))
        except ClientGone as e:
            return self._drop(e)
        return "200"  # the reader sees the pump end and closes the socket

    def _drop(self, reason: ClientGone) -> str:
        """The client cannot take more: its connection is cut (what it has not read is
        dropped); the synthesis is cancelled when the pump ends."""
        logger.info("%s: %s after %d chunks; synthesis cancelled", self.rid, reason, self.chunks)
        if self.request.transport is not None:
            self.request.transport.abort()
        self.outcome = "aborted"
        return self.outcome

    def _counts(self) -> dict:
        stats = self.result.stats or {}
        return {"frames": int(stats.get("frames", 0)), "samples": self.samples,
                "text_tokens": int(stats.get("text_tokens", 0)),
                "capped": capped(self.result)}  # fmt: skip

    async def _fail(self, error: RequestError) -> str:
        self.error = error
        self.outcome = str(error.status)
        logger.info("%s: error %d: %s", self.rid, error.status, error.message)
        with contextlib.suppress(ClientGone, RuntimeError):
            await self._send_json(error_event(error, self.config.retry_after_s))
        # closed by `run` (the reader's task) with this code and reason
        self.close_code = CLOSE_CLIENT_ERROR if error.status < 500 else CLOSE_SERVER_ERROR
        self.close_reason = error.message[:120].encode(errors="replace")
        return str(error.status)

    async def _send_json(self, data: dict) -> None:
        await self._send(self.ws.send_str(json.dumps(data)))

    async def _send_bytes(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone("the client went away")
        if transport.get_write_buffer_size() > self.send_bound:
            raise ClientGone("the client stopped reading (send buffer full)")
        await self._send(self.ws.send_bytes(data))

    async def _send(self, coro) -> None:
        """One frame, whole; a client that stops reading ends the session after the timeout."""
        async with self._send_lock:
            try:
                async with asyncio.timeout(
                    self.config.ws_send_timeout_s
                ):  # (wait_for: see handler.py)
                    await coro
            except TimeoutError:
                raise ClientGone("the client stopped reading (send timed out)") from None
            except ConnectionError as e:
                raise ClientGone(f"the client went away ({e})") from None
