"""One utterance spoken over the engine's streaming-text WebSocket on one endpoint: its text goes
to the engine as the LLM writes it, and the audio comes back while text still arrives. The socket
transport of the failover loop (`failover.py`).

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
    EV_DONE,
    EV_ERROR,
    EV_FIRST_AUDIO,
    EV_SESSION_CREATED,
    MSG_TEXT_APPEND,
    MSG_TEXT_END,
    SAMPLE_RATE,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    rate_mismatch,
    retry_after_s,
    stream_error,
)
from .replay import play_unheard
from .segment_text import SegmentText


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

    @property
    def samples(self) -> int:
        return self.delivered_bytes // 2


async def _close(ws: aiohttp.ClientWebSocketResponse, sender: asyncio.Task) -> None:
    await asyncio.gather(sender, return_exceptions=True)
    await ws.close()


class NoTextStreaming(Exception):
    """The engine chosen for a segment does not take streamed text and nothing has played yet:
    the segment is spoken as sentences instead."""


class SocketAttempt:
    """`text` over one socket per try: `session.start` (`start`, with its seed), the text so far
    in one append, each later piece as it comes, then `input_text.end`; PCM into `deliver`.

    `ask_engine`: read each endpoint's status first ("auto") rather than assume the socket; an
    endpoint without it raises NoTextStreaming where `may_fall_back` and nothing was played."""

    def __init__(
        self, *, pool: EndpointPool, session: aiohttp.ClientSession, headers: dict[str, str],
        start: dict, text: SegmentText, report: TextStreamReport, conn: APIConnectOptions,
        deliver: Callable[[bytes], None], on_sent: Callable[[], None], ask_engine: bool,
        may_fall_back: bool,
    ) -> None:  # fmt: skip
        self._pool, self._session, self._headers = pool, session, headers
        self._start, self._text, self._conn = start, text, conn
        self._deliver, self._on_sent = deliver, on_sent
        self._ask_engine, self._may_fall_back = ask_engine, may_fall_back
        self._ended = False  # input_text.end was sent on the current socket
        self._t0 = time.perf_counter()  # first audio is counted from the utterance's first try
        self.report = report
        report.seed = start.get("seed")
        report.first_chunk_frames = start.get("first_chunk_frames")
        self.what = "a streamed utterance"

    async def run(self, ep: Endpoint) -> None:
        if self._ask_engine and not await self._pool.streams_text(ep, self._conn.timeout):
            if self._may_fall_back and self.report.delivered_bytes == 0:
                raise NoTextStreaming(ep.url)
            raise SocketLost(f"{ep.url} does not take streamed text")
        report = self.report
        attrs = {"qwen3_tts.endpoint": ep.url, "qwen3_tts.text_input": "stream"}
        with tracer.start_as_current_span("qwen3_tts.text_stream", kind=SpanKind.CLIENT,
                                          attributes=attrs) as span:  # fmt: skip
            headers = dict(self._headers)
            propagate.inject(headers)  # the engine continues LiveKit's trace (W3C traceparent)
            ws = await self._connect(ep, headers)
            sender = asyncio.create_task(self._send(ws), name="qwen3-tts-text")
            try:
                await self._receive(ws, sender)
            finally:
                # Shielded: LiveKit cancels a closing stream's tasks twice (aio.cancel_and_wait
                # after gather's cancel); the socket must close all the same, and the engine
                # cancels an utterance whose socket closes.
                sender.cancel()
                await asyncio.shield(_close(ws, sender))
                span.set_attributes({"qwen3_tts.variant": report.variant or "",
                                     "qwen3_tts.text_chars": len(report.text),
                                     "qwen3_tts.first_audio_s": report.first_audio_s or -1.0,
                                     "qwen3_tts.delivered_bytes": report.delivered_bytes})  # fmt: skip

    async def _connect(
        self, ep: Endpoint, headers: dict[str, str]
    ) -> aiohttp.ClientWebSocketResponse:
        url = "ws" + ep.url.removeprefix("http") + SPEECH_STREAM_PATH
        timeout = self._conn.timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._session.ws_connect(
                    url, protocols=(SPEECH_STREAM_SUBPROTOCOL,), headers=headers,
                    # A peer that stops answering pings is found within `timeout` of the last
                    # message while the text is still open (the engine may rightly be silent).
                    heartbeat=timeout * 2 / 3,
                    timeout=aiohttp.ClientWSTimeout(ws_close=min(1.0, timeout)),
                )  # fmt: skip
        except TimeoutError:
            raise Stalled(f"no WebSocket upgrade for {timeout:g} s") from None
        except aiohttp.WSServerHandshakeError as e:
            if e.status == 429:  # too many sessions open there: another engine may have room
                retry_after = e.headers.get("Retry-After") if e.headers else None
                raise EngineFull(retry_after_s(retry_after), e.message) from e
            if e.status >= 500 or e.status < 400:
                raise EndpointUnavailable(e.status, e.message) from e
            raise APIStatusError(f"Qwen3-TTS refused the text stream at {ep.url}: HTTP {e.status}",
                                 status_code=e.status, body=e.message) from e  # fmt: skip

    async def _send(self, ws) -> None:
        """The start, the text so far in one append (all of it after a failover), each later
        piece as it comes, then the end."""
        self._ended = False
        report = self.report
        report.text = ""
        await ws.send_json(self._start)
        async for batch in self._text.read():
            piece = "".join(batch)
            await ws.send_json({"type": MSG_TEXT_APPEND, "text": piece})
            report.text += piece
            self._on_sent()  # the text goes to the model now: LiveKit's TTFB starts here
        await ws.send_json({"type": MSG_TEXT_END})
        self._ended = True

    async def _receive(self, ws, sender: asyncio.Task) -> None:
        report = self.report
        received = 0  # audio bytes of this socket
        created = False
        while True:
            if sender.done() and sender.exception() is not None:
                raise SocketLost(f"sending failed: {sender.exception()}")
            # Bounded while the engine owes an answer: to the start, and after the text ended.
            # While text is open the engine may be silent for as long as the LLM is: the
            # heartbeat finds a dead peer then.
            owed = not created or self._ended
            try:
                msg = await ws.receive(timeout=self._conn.timeout if owed else None)
            except TimeoutError:
                raise Stalled(
                    f"no answer for {self._conn.timeout:g} s after {received} bytes"
                ) from None
            if msg.type == aiohttp.WSMsgType.BINARY:
                play_unheard(report, msg.data, received, self._t0, self._deliver)
                received += len(msg.data)
                if report.first_audio_before_end is None and report.first_audio_s is not None:
                    report.first_audio_before_end = not self._ended
                continue
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
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == EV_SESSION_CREATED:
                if why := rate_mismatch(
                    self._start.get("sample_rate", SAMPLE_RATE), event.get("sample_rate")
                ):
                    raise APIError(why, retryable=False)
                created = True
                report.request_ids.append(str(event.get("id") or ""))
                report.variant = event.get("variant") or report.variant
            elif kind == EV_FIRST_AUDIO and report.engine_first_audio_ms is None:
                report.engine_first_audio_ms = event.get("ms")
            elif kind == EV_DONE:
                # Before the text ended, only a frame cap ends an utterance (the model cannot
                # end it before input_text.end): the caller decides what becomes of the rest.
                report.ended_early = not self._ended
                report.capped = event.get("capped") is True
                if report.capped:
                    logger.warning("TTS utterance %s ran to the engine's frame cap (%s frames) "
                                   "instead of ending by itself: %r",
                                   report.request_ids[-1] if report.request_ids else "?",
                                   event.get("frames"), report.text[:60])  # fmt: skip
                return
            elif kind == EV_ERROR:
                status, message = stream_error(event)
                if status == 429:  # `engine_full`: its batch and queue; another may have room
                    after = event.get("retry_after_s")
                    raise EngineFull(retry_after_s(None if after is None else str(after)), msg.data)
                if status >= 500:  # this engine is broken or busy; another may not be
                    raise EndpointUnavailable(status, message)
                request_id = report.request_ids[-1] if report.request_ids else None
                raise APIStatusError(message, status_code=status, request_id=request_id,
                                     body=msg.data)  # fmt: skip
