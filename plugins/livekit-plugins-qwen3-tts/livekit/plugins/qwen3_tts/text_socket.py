"""One utterance spoken over the engine's streaming-text WebSocket on one endpoint: its text goes
to the engine as the LLM writes it, and the audio comes back while text still arrives. The socket
transport of the failover loop (`failover.py`). The socket is a warm one, kept open between
utterances (`socket_pool.py`); one closed while it waited is replaced before the start is lost.

Failover: when a socket fails, the utterance goes to the next endpoint with the same seed, the
text so far is replayed in one append, and the audio bytes already played are skipped. The
engine makes the same codes whichever way the same text arrives (its equivalence tests), so
this is sample-exact with the same checkpoint and variant, as the HTTP path's failover is.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from livekit.agents import APIConnectOptions, APIError, APIStatusError
from livekit.agents.telemetry import tracer
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from .endpoints import Endpoint, EndpointPool
from .failover import EngineFull
from .failures import EndpointUnavailable, SocketLost, Stalled
from .log import logger
from .protocol import (
    EV_ERROR,
    SAMPLE_RATE,
    finish_reason,
    rate_mismatch,
    retry_after_s,
    stream_error,
)
from .replay import play_unheard
from .segment_text import SegmentText
from .socket_dialects import DIALECTS
from .socket_pool import SocketPool, WarmSocket


@dataclass
class TextStreamReport:
    """What happened to one utterance sent over the streaming-text socket."""

    text: str = ""  # the text the last socket was given
    delivered_bytes: int = 0
    endpoints: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)  # endpoints that answered 429 (engine full)
    request_ids: list[str] = field(default_factory=list)  # the engine's, one per socket
    variant: str | None = None
    seed: int | None = None  # sent on every socket, so that a failover repeats the same audio
    first_chunk_frames: int | None = None
    # Its first socket was open before it asked for one (parked in the pool, or prewarmed):
    # no TCP handshake, no upgrade.
    warm: bool | None = None
    first_audio_s: float | None = None  # from the utterance's first socket opening
    engine_first_audio_ms: float | None = None  # the engine's `response.first_audio`
    # Whether the first audio came while the text was still open (before input_text.end).
    first_audio_before_end: bool | None = None
    skipped_bytes: int = 0  # audio made again after a failover but not played again
    # The engine said `response.done` before the text had ended: its `max_new_tokens` cap.
    ended_early: bool = False
    # The engine's `response.done` said `"capped": true`: the utterance ran to its frame cap (it
    # never ended by itself: the tail may be room tone).
    capped: bool = False
    finish_reason: str | None = None  # why the engine ended it (`protocol.finish_reason`)

    @property
    def samples(self) -> int:
        return self.delivered_bytes // 2


class NoTextStreaming(Exception):
    """The engine chosen for a segment does not take streamed text and nothing has played yet:
    the segment is spoken as sentences instead."""


class _Stale(Exception):
    """A socket taken from the pool was gone before the engine took the start (closed while it
    was parked): the utterance goes on a new socket to the same endpoint, nothing lost."""


class SocketAttempt:
    """`text` over one socket per try (a warm one from `sockets`), in the dialect of the endpoint
    tried (`socket_dialects.py`): its opening message (`starts[protocol]`, with the seed), the
    text so far in one piece, each later piece as it comes, then the end; PCM into `deliver`.
    Once the engine says the utterance is done the socket goes back to the pool; cancelled
    (barge-in) it is given `response.cancel` first where the dialect has one
    (`SocketPool.cancel`), else closed (the engine stops on the close); failed, it is closed.

    `ask_engine`: read each endpoint's status first ("auto") rather than assume the socket (a
    vLLM-Omni endpoint has none: its upgrade's 404 says no); an endpoint without it raises
    NoTextStreaming where `may_fall_back` and nothing was played."""

    def __init__(
        self, *, pool: EndpointPool, sockets: SocketPool, starts: dict[str, dict],
        text: SegmentText, report: TextStreamReport, conn: APIConnectOptions,
        deliver: Callable[[bytes], None], on_sent: Callable[[], None], ask_engine: bool,
        may_fall_back: bool,
    ) -> None:  # fmt: skip
        self._pool, self._sockets = pool, sockets
        self._starts, self._text, self._conn = starts, text, conn
        self._deliver, self._on_sent = deliver, on_sent
        self._ask_engine, self._may_fall_back = ask_engine, may_fall_back
        self._ended = False  # the text's end was sent on the current socket
        self._started = False  # the opening message went to the current socket
        self._done = False  # the current socket said the utterance is done
        self._flush = 0  # vLLM-Omni's dialect: this utterance's flush index on the socket
        self._t0 = time.perf_counter()  # first audio is counted from the utterance's first try
        self.report = report
        start = next(iter(starts.values()))
        report.seed = start.get("seed")
        report.first_chunk_frames = start.get("first_chunk_frames")
        self.what = "a streamed utterance"

    async def run(self, ep: Endpoint) -> None:
        if self._ask_engine and not await self._takes_text(ep):
            if self._may_fall_back and self.report.delivered_bytes == 0:
                raise NoTextStreaming(ep.url)
            raise SocketLost(f"{ep.url} does not take streamed text")
        report = self.report
        attrs = {"qwen3_tts.endpoint": ep.url, "qwen3_tts.text_input": "stream",
                 "qwen3_tts.protocol": ep.protocol}  # fmt: skip
        with tracer.start_as_current_span("qwen3_tts.text_stream", kind=SpanKind.CLIENT,
                                          attributes=attrs) as span:  # fmt: skip
            first = report.warm is None  # the utterance's first endpoint
            while True:
                try:
                    sock = await self._sockets.get(ep.url, self._conn.timeout, ep.protocol)
                except APIStatusError as e:
                    if e.status_code == 404 and self._ask_engine and ep.protocol != "qwen3-tts":
                        ep.streaming_text = False  # a vLLM-Omni without the socket: sentences
                        if self._may_fall_back and report.delivered_bytes == 0:
                            raise NoTextStreaming(ep.url) from e
                    raise
                if first:  # of the socket that takes the start (after a stale one: a new one)
                    report.warm = sock.reused
                try:
                    await self._speak_on(sock)
                    break
                except _Stale as e:  # a new socket is next (a stale one is never handed out twice)
                    logger.info("TTS socket to %s was closed while idle (%s): reconnecting",
                                ep.url, e)  # fmt: skip
            span.set_attributes({"qwen3_tts.variant": report.variant or "",
                                 "qwen3_tts.text_chars": len(report.text),
                                 "qwen3_tts.warm_socket": bool(report.warm),
                                 "qwen3_tts.first_audio_s": report.first_audio_s or -1.0,
                                 "qwen3_tts.finish_reason": report.finish_reason or "",
                                 "qwen3_tts.delivered_bytes": report.delivered_bytes})  # fmt: skip

    async def _takes_text(self, ep: Endpoint) -> bool:
        if ep.protocol == "qwen3-tts":  # the engine's status says
            return await self._pool.streams_text(ep, self._conn.timeout)
        return ep.streaming_text is not False  # vLLM-Omni: until its upgrade answered 404

    async def _speak_on(self, sock: WarmSocket) -> None:
        """The utterance on `sock`; the socket goes back to the pool, to a barge-in's cancel, or
        is closed, by how it ended."""
        self._started = self._done = False
        dialect = DIALECTS[sock.protocol]
        sender = asyncio.create_task(self._send(sock, dialect), name="qwen3-tts-text")
        cancelled = False
        try:
            await self._receive(sock, dialect, sender)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            # No await here: LiveKit cancels a closing stream's tasks twice (aio.cancel_and_wait
            # after gather's cancel); what becomes of the socket happens in the pool's tasks.
            clean = self._done and not self.report.ended_early and sender.done()
            sender.cancel()
            if clean or (cancelled and not self._started):  # nothing of this utterance is on it
                self._sockets.put(sock)
            elif cancelled and not self._done and sock.alive and dialect.can_cancel:
                self._sockets.cancel(sock, sender, bound=self._conn.timeout)  # barge-in
            else:  # failed, or its state is unknown (the engine ended it before the text did)
                self._sockets.discard(sock)

    async def _send(self, sock: WarmSocket, dialect) -> None:
        """The opening, the text so far in one piece (all of it after a failover), each later
        piece as it comes, then the end."""
        self._ended = False
        ws, report = sock.ws, self.report
        report.text = ""
        start = dialect.opening(self._starts, sock.flushes)
        # The socket may have been opened by another utterance or by prewarm(): this
        # utterance's trace context goes with its start (W3C traceparent, as on POST's headers).
        propagate.inject(start)
        self._flush = sock.flushes
        self._started = True  # set first: a send cancelled midway has written its frame
        await ws.send_json(start)
        async for batch in self._text.read():
            piece = "".join(batch)
            await ws.send_json(dialect.piece(piece))
            report.text += piece
            self._on_sent()  # the text goes to the model now: LiveKit's TTFB starts here
        sock.flushes += 1
        await ws.send_json(dialect.end())
        self._ended = True

    async def _receive(self, sock: WarmSocket, dialect, sender: asyncio.Task) -> None:
        ws, report = sock.ws, self.report
        received = 0  # audio bytes of this socket
        created = False  # the engine took this utterance (its first event of it)
        endings: list[str] = []  # vLLM-Omni's dialect: each sentence's finish reason
        while True:
            if sender.done() and not sender.cancelled() and sender.exception() is not None:
                if sock.reused and not created:
                    raise _Stale(f"sending failed: {sender.exception()}")
                raise SocketLost(f"sending failed: {sender.exception()}")
            # Bounded while the engine owes an answer: to the start (where the dialect answers
            # it), and after the text ended. While text is open the engine may be silent for
            # as long as the LLM is: the heartbeat finds a dead peer then.
            owed = (dialect.owes_start and not created) or self._ended or sender.done()
            try:
                msg = await self._next_message(ws, sender, owed)
            except TimeoutError:
                raise Stalled(
                    f"no answer for {self._conn.timeout:g} s after {received} bytes"
                ) from None
            if msg.type == aiohttp.WSMsgType.BINARY:
                if not created:  # no audio comes before the utterance's first event
                    logger.warning("TTS socket to %s sent audio before the utterance began: "
                                   "ignored", sock.url)  # fmt: skip
                    continue
                play_unheard(report, msg.data, received, self._t0, self._deliver)
                received += len(msg.data)
                if report.first_audio_before_end is None and report.first_audio_s is not None:
                    report.first_audio_before_end = not self._ended
                continue
            if msg.type != aiohttp.WSMsgType.TEXT and sock.reused and not created:
                code = msg.data if msg.type == aiohttp.WSMsgType.CLOSE else ws.close_code
                raise _Stale(f"{msg.type.name} (code {code}) before the utterance began")
            if msg.type == aiohttp.WSMsgType.ERROR:
                if isinstance(msg.data, TimeoutError):  # no pong: the peer stalled
                    raise Stalled(f"the socket stalled after {received} bytes: {msg.data}")
                raise SocketLost(f"the socket failed after {received} bytes: {msg.data}")
            if msg.type != aiohttp.WSMsgType.TEXT:  # CLOSE, CLOSING, CLOSED
                raise SocketLost(f"the socket closed (code {ws.close_code}) after {received} "
                                 "bytes, before the utterance was done")  # fmt: skip
            try:
                event = json.loads(msg.data)
            except ValueError:
                logger.warning("the engine sent a text frame that is not JSON: %r", msg.data[:100])
                continue
            if not isinstance(event, dict):
                continue
            if event.get("type") == EV_ERROR:
                self._raise_error(event, msg.data)
            heard = dialect.read(event, created, self._flush)
            if heard.kind == "begun":
                if why := rate_mismatch(self._asked_rate(sock), heard.sample_rate):
                    raise APIError(why, retryable=False)
                created = True
                report.request_ids.append(heard.request_id or "")
                report.variant = heard.variant or report.variant
            elif heard.kind == "first_audio" and report.engine_first_audio_ms is None:
                report.engine_first_audio_ms = heard.ms
            elif heard.kind == "sentence_done" and heard.finish_reason:
                endings.append(heard.finish_reason)
            elif heard.kind == "done":
                self._done = True
                # Before the text ended, only a frame cap ends an utterance (the model cannot
                # end it before its text ends): the caller decides what becomes of the rest.
                report.ended_early = not self._ended
                said = heard.finish_reason or next((r for r in endings if r != "stop"), None)
                report.capped = heard.capped or said == "length"
                report.finish_reason = finish_reason(said, capped=report.capped)
                return
            elif heard.kind == "other":
                logger.debug("TTS socket to %s: %r not of this utterance: ignored", sock.url,
                             event.get("type"))  # fmt: skip

    async def _next_message(self, ws: aiohttp.ClientWebSocketResponse, sender: asyncio.Task,
                            owed: bool) -> aiohttp.WSMessage:  # fmt: skip
        """The socket's next message: within `conn.timeout` when the engine owes one, else with
        no bound until the text ends (the sender is done) and within `conn.timeout` from then:
        a wait begun while the text was open is bounded once the engine owes its answer.
        (TimeoutError when it does not come.)"""
        timeout = self._conn.timeout
        async with asyncio.timeout(timeout if owed else None) as bound:
            if owed:
                return await ws.receive()
            loop, waiting = asyncio.get_running_loop(), True

            def text_ended(_: asyncio.Task) -> None:
                if waiting:  # (a callback already scheduled may run after the wait is over)
                    bound.reschedule(loop.time() + timeout)

            sender.add_done_callback(text_ended)
            try:
                return await ws.receive()
            finally:
                waiting = False
                sender.remove_done_callback(text_ended)

    def _asked_rate(self, sock: WarmSocket) -> int:
        return self._starts.get(sock.protocol, {}).get("sample_rate", SAMPLE_RATE)

    def _raise_error(self, event: dict, body: str) -> None:
        status, message = stream_error(event)
        if status == 429:  # `engine_full`: its batch and queue; another may have room
            after = event.get("retry_after_s")
            raise EngineFull(retry_after_s(None if after is None else str(after)), body)
        if status >= 500:  # this engine is broken or busy; another may not be
            raise EndpointUnavailable(status, message)
        request_id = self.report.request_ids[-1] if self.report.request_ids else None
        raise APIStatusError(message, status_code=status, request_id=request_id, body=body)
