"""The core of the engine's speech WebSockets, whatever their dialect: one socket carries
utterances one after another, each with its own request, text and synthesis.

`SocketHub` accepts sockets (the session cap, the send bounds, the span, the counters) for every
dialect at once; `SocketSession` serves one: the reader (the route's task: it alone reads and
closes the socket), the limits (`session_limits.py`, one set for every dialect) and timeouts, the
bounded sends and flow control, and the pump of its current `Utterance` (a task of its own),
whose states and commands are `session_core.py`'s. A dialect (`speech_stream.py`,
`qwen_realtime.py`, `vllm_omni_stream.py`) subclasses it as a translator: `handle` turns the
client's messages into the commands (`open_utterance` (configure), `append`, `end_text` (flush),
`cancel`, `closing`), the `send_*` hooks word the events (started, audio, done with its
`finish_reason`, error).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import socket
import struct
import sys
import termios
import time
from collections.abc import Callable

from aiohttp import WSMsgType, web
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from qwen3_tts_engine.dispatch.handler import Result
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    ENGINE_FULL,
    HEADER_REQUEST_ID,
    RequestError,
    SpeechRequest,
    check_input,
    check_length,
)
from qwen3_tts_engine.serving.errors import MAPPED, as_request_error, error_response
from qwen3_tts_engine.serving.session_core import MOVES, OVER, Command, State, allowed, check_piece
from qwen3_tts_engine.serving.session_limits import SessionLimits, close_reason
from qwen3_tts_engine.serving.speech_service import (
    SpeechService,
    capped,
    decode_json,
)
from qwen3_tts_engine.serving.tracing import extract_context, tracer

CLOSE_CLIENT_ERROR, CLOSE_SERVER_ERROR = 1008, 1011

_ids = itertools.count(1)


class ClientGone(Exception):
    """The client cannot take more: it closed, or stopped reading (its buffer is full)."""


class SessionEnd(Exception):
    """The socket ends with this error event (a RequestError's status and body)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class Utterance:
    """One utterance of a socket: its request, its text as it comes, its synthesis and counts."""

    def __init__(self, rid: str, req: SpeechRequest, ref_audio: bytes | None,
                 text: TextInput) -> None:  # fmt: skip
        self.rid = rid
        self.req = req
        self.ref_audio = ref_audio
        self.text = text
        self.t0 = time.perf_counter()
        self.result = Result()
        self.pump: asyncio.Task | None = None  # None until its text begins
        self._state = State.WAITING
        self.finish_reason: str | None = None  # once over: protocol.FINISH_REASONS
        self.reason_counted = False  # in qwen3_tts_utterances_finished_total (once)
        self.counted = False  # in the requests metric
        self.holds = 0  # times its pump waited for the client to read (flow control)
        self.chunks = 0
        self.samples = 0
        self.acked_tokens = -1
        self.span: trace.Span | None = None  # `qwen3_tts.utterance`, from its synthesis's start
        # the caller's trace context for this utterance: its start's `traceparent`, else the socket's
        self.trace_context: otel_context.Context | None = None

    @property
    def state(self) -> State:
        """Its state now (a text ended from outside the core, e.g. by a backlog, is FLUSHING)."""
        if self._state is State.TEXT_OPEN and self.text.ended:
            self._state = State.FLUSHING
        return self._state

    def move(self, to: State) -> None:
        if to is not self.state:
            assert to in MOVES[self.state], (self.state, to)
            self._state = to

    @property
    def settled(self) -> bool:
        """Over: its end (done, cancelled) was sent; it holds no stream and no slot."""
        return self.state in OVER

    def counts(self) -> dict:
        stats = self.result.stats or {}
        return {"frames": int(stats.get("frames", 0)), "samples": self.samples,
                "text_tokens": int(stats.get("text_tokens", 0)),
                "capped": capped(self.result), "finish_reason": self.finish_reason}  # fmt: skip


class SocketHub:
    """The speech WebSockets of an `EngineServer`, all protocols: one session cap, one count."""

    def __init__(self, service: SpeechService) -> None:
        self.service = service
        self.config = service.config
        self.metrics = service.metrics
        self.sessions: set[SocketSession] = set()  # open sockets

    def session_counts(self) -> tuple[int, int]:
        """(sockets open, those holding no stream and no slot: waiting for their first text,
        or between utterances)."""
        return len(self.sessions), sum(1 for s in self.sessions if not s.streaming)

    async def serve(self, request: web.Request, make: Callable[..., SocketSession],
                    protocols: tuple[str, ...], name: str) -> web.StreamResponse:  # fmt: skip
        """Upgrade `request` and serve it with the session `make(hub, ws, request, rid)` gives;
        `name` labels the protocol in the metrics."""
        rid = request.headers.get(HEADER_REQUEST_ID) or f"tts-ws-{next(_ids)}"
        config, limits = self.config, SessionLimits.of(self.config)
        # writer_limit above the send bound: the bound (not aiohttp's drain) meets a stuck client
        ws = web.WebSocketResponse(protocols=protocols, max_msg_size=config.max_body_bytes,
                                   writer_limit=2 * limits.send_buffer_bytes,
                                   heartbeat=limits.heartbeat_s or None,
                                   # no permessage-deflate: nothing a client sends is inflated
                                   # (PCM does not compress much either); pings are counted
                                   compress=False, autoping=False)  # fmt: skip
        if not ws.can_prepare(request).ok:
            wanted = f" (subprotocol {protocols[0]})" if protocols else ""
            return error_response(RequestError(f"{request.path} takes a WebSocket upgrade{wanted}"))
        if len(self.sessions) >= limits.max_sessions:  # before the upgrade: a plain 429
            self.metrics.requests.labels("429").inc()
            return error_response(RequestError(f"{len(self.sessions)} sessions are open (--max-sessions "
                                               f"{limits.max_sessions})", status=429, code=ENGINE_FULL),
                                  retry_after_s=config.retry_after_s)  # fmt: skip
        with tracer.start_as_current_span("qwen3_tts.speech_stream", context=extract_context(request.headers),
                                          kind=SpanKind.SERVER,
                                          attributes={"qwen3_tts.request_id": rid,
                                                      "qwen3_tts.protocol": name}) as span:  # fmt: skip
            try:
                await ws.prepare(request)
            except ConnectionError as e:  # reset while upgrading: nothing to serve, no traceback
                logger.info("%s: the client went away during the upgrade (%s)", rid, e)
                span.set_attribute("qwen3_tts.outcome", "aborted")
                return ws
            _bound_kernel_buffer(request, limits.send_buffer_bytes)
            self.metrics.socket_connections.labels(name).inc()
            session = make(self, ws, request, rid)
            self.sessions.add(session)
            try:
                await session.run()
            except ConnectionError as e:  # a reset the session met outside a send
                logger.info("%s: connection lost (%s)", rid, e)
            finally:  # also when aiohttp cancels the handler as the connection goes
                self.sessions.discard(session)
                session.count_leftover()
                self.metrics.socket_utterances.labels(name).observe(session.started)
                span.set_attribute("qwen3_tts.outcome", session.outcome or "cancelled")
                span.set_attribute("qwen3_tts.utterances", session.started)
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


class SocketSession:
    """One socket. Subclasses give the protocol: `handle` (a client message), the `send_*`
    events, and `after_utterance` (what follows an utterance's end)."""

    def __init__(self, hub: SocketHub, ws: web.WebSocketResponse, request: web.Request,
                 rid: str) -> None:  # fmt: skip
        self.service = hub.service
        self.config = hub.config
        self.metrics = hub.metrics
        self.ws = ws
        self.request = request
        self.send_bound = hub.config.ws_send_buffer_bytes  # this socket's, from its start
        self.rid = rid
        self.utterance: Utterance | None = None  # the current one, or the last (settled)
        self.started = 0  # utterances begun on this socket
        self.messages = 0  # from the client since the current utterance began (ws_max_messages)
        self.idle_since = time.perf_counter()  # with no utterance in progress, since when
        # the client's last message (text or binary; pings and pongs are not messages): the idle
        # and keepalive limits count from it, so a heartbeat keeps no silent client alive
        self.last_message = self.idle_since
        self.error: RequestError | None = None
        self.outcome: str | None = None  # the last one counted: a status, "aborted", "cancelled"
        self.closing = False  # the socket ends (normally) after the current message
        self.close_code, self.close_reason = 1000, b""  # what `run` closes the socket with
        self._send_lock = asyncio.Lock()

    @property
    def limits(self) -> SessionLimits:
        """The core's limits, as the server's config says now (each check reads them anew)."""
        return SessionLimits.of(self.config)

    # -- what a protocol says ----------------------------------------------------------------

    async def handle(self, body: dict) -> None:
        """One client message (a JSON object with a string "type"); RequestError or SessionEnd
        end the socket with an error event."""
        raise NotImplementedError

    def error_event(self, error: RequestError) -> dict:
        raise NotImplementedError

    async def send_audio(self, utt: Utterance, pcm: bytes) -> None:
        raise NotImplementedError

    async def send_started(self, utt: Utterance) -> None:
        """The utterance opened (`open_utterance`), before its synthesis starts (optional)."""

    def text_open(self) -> bool:
        """Whether the client has text open (more is due: the idle limit applies). The current
        utterance's by default; a dialect that queues text says so of its queue too."""
        utt = self.utterance
        return utt is not None and not utt.settled and not utt.text.ended

    # wire bytes per byte of PCM (the flow control's measure; base64 in JSON: 4/3)
    wire_ratio = 1.0

    async def send_first_audio(self, utt: Utterance, ms: float) -> None:
        """After the first chunk went out (optional)."""

    async def send_done(self, utt: Utterance) -> None:
        """The utterance's audio is all out (its `finish_reason` is set)."""
        raise NotImplementedError

    async def after_utterance(self, utt: Utterance) -> None:
        """The utterance is over (done or cancelled): e.g. start the next one (optional)."""

    async def on_open(self) -> None:
        """Right after the upgrade (optional)."""

    # -- the socket ---------------------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        """Whether the socket holds a stream now (its utterance's text has begun, not ended)."""
        utt = self.utterance
        return utt is not None and utt.pump is not None and not utt.settled

    async def run(self) -> None:
        """Serve the socket to its end."""
        try:
            await self.on_open()
            await self._read()
            utt = self.utterance
            # the client stopped sending: an utterance whose text has ended is finished (audio
            # to a client that closed finds it gone); before its end, the close cancels it
            if utt is not None and utt.pump is not None and not utt.settled and utt.text.ended:
                self._count(utt, await utt.pump)
                utt.move(State.DONE)
        except SessionEnd as e:
            await self._fail(e.error)
        except ClientGone as e:  # a send found the client gone or stuck
            self._drop(e)
        finally:
            utt = self.utterance
            if utt is not None and utt.pump is not None and not utt.pump.done():
                # the client went away (or the socket failed): the synthesis stops, its slot frees
                utt.pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await utt.pump
                logger.info(
                    "%s: socket closed after %d chunks; synthesis cancelled", utt.rid, utt.chunks
                )
            if not self.ws.closed:  # from this task, the only reader: a whole closing handshake
                await self.ws.close(code=self.close_code, message=self.close_reason)

    def count_leftover(self) -> None:
        """At the socket's end: its unfinished utterance counts as cancelled (as does a socket
        that never began one and ended without an error)."""
        utt = self.utterance
        if utt is not None and not utt.counted:
            self._count(utt, "cancelled")
        elif utt is None and self.outcome is None:
            self._count(None, "cancelled")

    def _count(self, utt: Utterance | None, outcome: str) -> None:
        if utt is not None:
            if utt.counted:
                return
            utt.counted = True
        self.outcome = outcome
        self.metrics.requests.labels(outcome).inc()
        if utt is not None and utt.pump is not None and not utt.reason_counted:
            # a synthesis that did not run to its end (the pump's observe_done counts those):
            # cancelled or its client gone is `abort`, a failure `error`, counted by reason once
            utt.reason_counted = True
            reason = "abort" if outcome in ("cancelled", "aborted") else "error"
            utt.finish_reason = self.service.observe_finish(reason, utt.rid, utt.span)
        if utt is not None and utt.span is not None:
            utt.span.set_attribute("qwen3_tts.outcome", outcome)
            if outcome not in ("200", "cancelled"):
                utt.span.set_status(StatusCode.ERROR, outcome)
            utt.span.end()

    # -- client -> server --------------------------------------------------------------------

    async def _read(self) -> None:
        while not self.closing:
            timeout, expired = self._timeout()
            try:
                message = await self._receive(timeout)
            except TimeoutError:
                expired()
                continue
            if message is None:  # the synthesis ended (done, failed or dropped)
                await self._settle(self.utterance)
                continue
            if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return
            self.messages += 1
            if self.messages > self.limits.max_messages:
                raise SessionEnd(RequestError(f"more than {self.limits.max_messages} messages in "
                                              "one utterance (ws_max_messages)", status=429))  # fmt: skip
            if message.type == WSMsgType.PING:
                await self.ws.pong(message.data)
                continue
            if message.type == WSMsgType.PONG:  # the heartbeat's answer (aiohttp saw it)
                continue
            self.last_message = time.perf_counter()
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
                await self.handle(body)
            except RequestError as e:
                raise SessionEnd(e) from None

    async def _receive(self, timeout: float | None):
        """The client's next message, or None when the synthesis ends first. Only this task
        reads and closes the socket: aiohttp's close() from another task while a receive() waits
        cuts the connection right after its close frame, and the client's answer to it then
        fails (the client saw 1006 after a clean response.done)."""
        pump = self.utterance.pump if self.streaming else None
        if pump is None:
            return await self.ws.receive(timeout=timeout)
        receive = asyncio.ensure_future(self.ws.receive(timeout=timeout))
        try:
            await asyncio.wait({receive, pump}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive
        if receive.cancelled():
            return None
        return receive.result()  # (its TimeoutError too)

    def _timeout(self) -> tuple[float | None, Callable[[], None]]:
        """How long the next client message may take, and what happens when it does not come,
        all counted from the client's last message, never from a ping or a pong. An utterance's
        first text is due within first_text_s of its start; while text is open (`text_open`),
        a message within idle_s; while an utterance whose text ended speaks, the synthesis
        bounds the wait; with nothing in progress the socket closes (1000) after keepalive_s."""
        limits, utt, now = self.limits, self.utterance, time.perf_counter()
        in_progress = utt is not None and not utt.settled
        if in_progress and utt.text.chars == 0 and not utt.text.ended:
            return max(0.001, limits.first_text_s - (now - utt.t0)), self._first_text_expired
        if self.text_open():
            return max(0.001, limits.idle_s - (now - self.last_message)), self._idle_expired
        if in_progress:
            return None, self._idle_expired
        left = limits.keepalive_s - (now - max(self.idle_since, self.last_message))
        return max(0.001, left), self._keepalive_expired

    def _keepalive_expired(self) -> None:
        # nothing failed: a normal close, with the reason
        self.closing = True
        self.close_reason = close_reason(
            f"no utterance in progress and no message for {self.limits.keepalive_s:g} s "
            "(ws_keepalive_timeout_s)")  # fmt: skip

    def _first_text_expired(self) -> None:
        raise SessionEnd(RequestError(
            f"no text within {self.limits.first_text_s:g} s of the utterance's start "
            "(ws_first_text_timeout_s)", status=408, code="idle_timeout"))  # fmt: skip

    def _idle_expired(self) -> None:
        raise SessionEnd(RequestError(
            f"no message for {self.limits.idle_s:g} s while the text is open "
            "(ws_idle_timeout_s)", status=408, code="idle_timeout"))  # fmt: skip

    def require(self, command: Command, what: str) -> None:
        """The one check of a command against the current utterance's state."""
        utt = self.utterance
        state = utt.state if utt is not None else None
        if not allowed(state, command):
            now = "none is open" if state is None else f"the utterance is {state.value}"
            raise RequestError(f"{what}: not allowed now ({now})")

    # -- utterances (the commands, for the dialects) -----------------------------------------

    async def open_utterance(self, body: dict, text: TextInput | None = None) -> Utterance:
        """configure + start: a new current utterance (`start_utterance`), its started event,
        and its synthesis if it has text already."""
        utt = self.start_utterance(body, text)
        await self.send_started(utt)
        self.begin()
        return utt

    def start_utterance(self, body: dict, text: TextInput | None = None) -> Utterance:
        """A new current utterance from a request body (POST's fields; RequestError for a bad
        one), its text `text` or the body's `input`; its synthesis begins with its first text."""
        # W3C trace context of this utterance (a warm socket outlives the request that opened
        # it: a client sends each utterance's own `traceparent` in its start)
        carrier = {
            k: body.pop(k) for k in ("traceparent", "tracestate") if isinstance(body.get(k), str)
        }
        req, ref = self.service.prepare(body, streamed=True)
        text = text if text is not None else TextInput(req.input)
        req.input = ""  # the text goes to the worker as it arrives
        self.started += 1
        rid = self.rid if self.started == 1 else f"{self.rid}.{self.started}"
        self.utterance = utt = Utterance(rid, req, ref, text)
        utt.trace_context = extract_context(carrier) if carrier else None
        self.messages = 0
        return utt

    def begin(self) -> None:
        """Start the synthesis once there is text: until then the utterance holds no stream, no
        place in a queue and no real-time slot (`/load` counts it in sessions_waiting_for_text)."""
        utt = self.utterance
        if utt.pump is None and utt.text.chars:
            # its span: a child of the caller's span (or of the socket's); the pump's task runs in
            # it (observe_done's attributes and queue/synthesis children land there)
            utt.span = tracer.start_span("qwen3_tts.utterance", context=utt.trace_context,
                                         kind=SpanKind.SERVER,
                                         attributes={"qwen3_tts.request_id": utt.rid})  # fmt: skip
            with trace.use_span(utt.span, end_on_exit=False):
                chunks = self.service.stream(utt.req, utt.ref_audio, utt.result, text=utt.text)
                utt.pump = asyncio.ensure_future(self._pump(utt, chunks))
            utt.move(State.FLUSHING if utt.text.ended else State.TEXT_OPEN)

    def check_piece(self, text: object, param: str = "text") -> str:
        """A piece of text as a message brings it (every dialect's, before anything is cut or
        queued): a string, well formed, no longer than an utterance may be."""
        return check_piece(text, param, self.config.limits)

    def append(self, text: object, param: str = "text") -> None:
        """A piece of the current utterance's text, checked as it comes (the worker's tokenizer
        never sees a bad one) and over all pieces (as POST's `input`)."""
        utt = self.utterance
        text = self.check_piece(text, param)
        if utt.text.ended:
            raise RequestError("text appended after the utterance's text ended")
        self.require(Command.APPEND, "text appended")
        check_length(utt.text.chars + len(text), self.config.limits)
        utt.text.append(text)
        self.begin()

    def end_text(self) -> None:
        """flush: the current utterance's text is whole."""
        utt = self.utterance
        if not utt.text.ended:
            check_input(utt.text.text, self.config.limits)  # as POST checks `input`
            utt.text.end()
            self.begin()
            if utt.pump is not None:
                utt.move(State.FLUSHING)

    async def cancel(self) -> bool:
        """Cancel the current utterance (its synthesis stops, its slot frees); False when it had
        already ended (its done event went out; it is settled now)."""
        utt = self.utterance
        if utt is None or utt.settled:
            return False
        if utt.pump is not None and utt.pump.done():
            await self._settle(utt)
            return False
        if utt.pump is not None:
            utt.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await utt.pump
        utt.move(State.CANCELLED)
        utt.finish_reason = "abort"
        self.idle_since = time.perf_counter()
        self._count(utt, "cancelled")
        return True

    async def _settle(self, utt: Utterance) -> None:
        """The synthesis ended: its failure ends the socket (raised); else the utterance is over."""
        outcome = await utt.pump  # SessionEnd, ClientGone
        utt.move(State.DONE)
        self.idle_since = time.perf_counter()
        self._count(utt, outcome)
        try:
            await self.after_utterance(utt)
        except RequestError as e:
            raise SessionEnd(e) from None

    # -- server -> client --------------------------------------------------------------------

    async def _pump(self, utt: Utterance, chunks) -> str:
        """The synthesis: audio out as it is made, then the done event; the outcome."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await self.send_audio(utt, chunk.pcm)
                    self.service.observe_chunk(chunk, utt.result)
                    utt.chunks += 1
                    utt.samples += len(chunk.pcm) // 2
                    if utt.chunks == 1:
                        await self.send_first_audio(utt, (time.perf_counter() - utt.t0) * 1000)
                    await self._wait_for_reader(utt)  # before the next chunk is taken
            utt.finish_reason = self.service.observe_done(utt.result, utt.rid, utt.t0, utt.chunks)
            utt.reason_counted = True  # a cancel while the done event goes out is not an abort
            await self.send_done(utt)
        except MAPPED as e:
            raise SessionEnd(as_request_error(e)) from None
        return "200"  # the reader sees the pump end

    def _drop(self, reason: ClientGone) -> None:
        """The client cannot take more: its connection is cut (what it has not read is
        dropped); the synthesis is cancelled as the socket ends."""
        utt = self.utterance
        logger.info("%s: %s after %d chunks; synthesis cancelled", utt.rid if utt else self.rid,
                    reason, utt.chunks if utt else 0)  # fmt: skip
        if self.request.transport is not None:
            self.request.transport.abort()
        self._count(utt if utt is not None and not utt.settled else None, "aborted")

    async def _fail(self, error: RequestError) -> None:
        self.error = error
        utt = self.utterance
        self._count(utt if utt is not None and not utt.settled else None, str(error.status))
        logger.info("%s: error %d: %s", utt.rid if utt else self.rid, error.status, error.message)
        with contextlib.suppress(ClientGone, RuntimeError):
            await self.send_json(self.error_event(error))
        # closed by `run` (the reader's task) with this code and reason
        self.close_code = CLOSE_CLIENT_ERROR if error.status < 500 else CLOSE_SERVER_ERROR
        self.close_reason = close_reason(error.message)

    async def send_json(self, data: dict) -> None:
        await self._send(self.ws.send_str(json.dumps(data)))

    async def send_bounded(self, data: bytes | str) -> None:
        """Audio (binary, or an event carrying it): a client that stops reading is dropped once
        the send bound is full."""
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone("the client went away")
        if transport.get_write_buffer_size() > self.send_bound:
            raise ClientGone("the client stopped reading (send buffer full)")
        send = self.ws.send_bytes if isinstance(data, bytes) else self.ws.send_str
        await self._send(send(data))

    async def _send(self, coro) -> None:
        """One frame, whole; a client that stops reading ends the session after the timeout."""
        async with self._send_lock:
            try:
                async with asyncio.timeout(self.limits.send_timeout_s):  # (wait_for: handler.py)
                    await coro
            except TimeoutError:
                raise ClientGone("the client stopped reading (send timed out)") from None
            except ConnectionError as e:
                raise ClientGone(f"the client went away ({e})") from None

    # -- flow control ------------------------------------------------------------------------

    def unsent(self) -> int:
        """Bytes written for the client that it has not taken yet: the transport's buffer and
        the kernel's send queue."""
        transport = self.request.transport
        if transport is None:
            return 0
        sock = transport.get_extra_info("socket")
        return transport.get_write_buffer_size() + (_kernel_unsent(sock) if sock else 0)

    async def _wait_for_reader(self, utt: Utterance) -> None:
        """Take no more audio from the engine while more than ahead_s of it waits unsent: the
        engine's flow control then pauses the stream. A client that reads nothing for the send
        timeout is dropped (ClientGone)."""
        ahead = self.limits.ahead_s * utt.req.sample_rate * 2 * self.wire_ratio
        if ahead <= 0 or self.unsent() <= ahead:
            return
        utt.holds += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.send_timeout_s
        while self.unsent() > ahead:
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ClientGone("the client went away")
            if loop.time() > deadline:
                raise ClientGone("the client stopped reading (send timed out)")
            await asyncio.sleep(_HOLD_POLL_S)


_HOLD_POLL_S = 0.05  # how often a held stream looks at its client's buffer
_SO_NWRITE = 0x1024  # macOS: bytes in the socket's send buffer not yet sent


def _kernel_unsent(sock) -> int:
    """Bytes in the kernel's send queue of `sock` (sent and unacknowledged, or unsent); 0 where
    the platform does not say."""
    try:
        if sys.platform == "linux":
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        if sys.platform == "darwin":
            return sock.getsockopt(socket.SOL_SOCKET, _SO_NWRITE)
    except (OSError, ValueError):
        pass
    return 0
