"""Warm streaming-text sockets: one per agent session and endpoint, kept open between utterances
(LiveKit's `utils.ConnectionPool`, as its Cartesia plugin keeps its socket), so a reply after the
first pays no TCP handshake and no WebSocket upgrade. `text_socket.py` speaks on them.

A parked socket is read by a task of its own: it answers the engine's pings (aiohttp answers them
only inside `receive()`), notices a close (the engine's keepalive, a dead engine), after which
the socket is never handed out again, and retires the socket itself once it has been idle for
`max_idle_s` (LiveKit's pool checks its age only when a socket is taken: an idle call's socket
would otherwise stay open until the engine's keepalive closed it). A socket is parked only in a
known state: after `response.done`, or after a barge-in's `response.cancel` was answered by one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from livekit.agents import APIStatusError, utils
from opentelemetry import propagate

from .endpoints import EndpointPool
from .failover import EngineFull
from .failures import EndpointUnavailable, Stalled
from .log import logger
from .protocol import (
    EV_DONE,
    EV_ERROR,
    MSG_CANCEL,
    OMNI_INPUT_DONE,
    OMNI_SESSION_DONE,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    retry_after_s,
)
from .socket_dialects import DIALECTS

# A parked socket is retired (closed by its reader) this long after it was parked: below the
# engine's default `ws_keepalive_timeout_s` (300 s), so the plugin closes it before the engine would.
MAX_IDLE_S = 240.0
IDLE_CLOSE_REASON = b"idle"  # the close frame's reason when the plugin retires an idle socket
PREWARM_TIMEOUT_S = 10.0  # LiveKit's default `conn_options.timeout`
# vLLM-Omni closes a socket that sent no message for 30 s (its idle timeout; pings do not count):
# a parked socket of its dialect sends an empty flush (`input.done`, answered by `session.done`)
# this often, as LiveKit's Baseten plugin does.
OMNI_KEEPALIVE_S = 15.0


class WarmSocket:
    """One socket to one endpoint. `reused`: it was open before the utterance that holds it.
    Parked, it is retired after `max_idle_s` (`on_retired(self)` is then called)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, url: str, *,
                 protocol: str = "qwen3-tts", max_idle_s: float = MAX_IDLE_S,
                 keepalive_s: float | None = None,
                 on_retired: Callable[[WarmSocket], None] | None = None) -> None:  # fmt: skip
        self.ws, self.url, self.protocol = ws, url, protocol
        self.reused = False
        self.utterances = 0  # started on it
        self.flushes = 0  # vLLM-Omni's dialect: `input.done`s sent (the server counts them too)
        self.retired = False  # closed by its parked reader after `max_idle_s` idle
        self._max_idle_s, self._on_retired = max_idle_s, on_retired
        self._keepalive_s = keepalive_s  # parked: an empty flush this often (vLLM-Omni's dialect)
        self.keepalives = 0  # empty flushes sent
        self._dead = False  # the parked reader saw a close or a message nobody asked for
        self._reader: asyncio.Task | None = None
        self.park()  # a new socket waits in the pool (prewarm) until it is taken

    @property
    def alive(self) -> bool:
        return not (self._dead or self.ws.closed)

    def park(self) -> None:
        if self._reader is None and self.alive:
            deadline = time.monotonic() + self._max_idle_s  # the idle age counts from parking
            self._reader = asyncio.create_task(self._read_parked(deadline),
                                               name="qwen3-tts-warm-socket")  # fmt: skip

    async def take(self) -> bool:
        """Stop the parked reader; whether the socket can carry an utterance."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()  # a receive() cancelled keeps what it had not read (aiohttp's queue)
            await asyncio.gather(reader, return_exceptions=True)
        return self.alive

    async def close(self) -> None:
        await self.take()
        await self.ws.close()

    async def wait_closed(self) -> None:
        """Until the parked socket is closed: by the engine (its keepalive) or retired."""
        if self._reader is not None:
            await asyncio.shield(self._reader)

    async def _read_parked(self, deadline: float) -> None:
        # One deadline for the whole wait: receive()'s own timeout restarts at every ping and
        # pong (aiohttp), which the heartbeat sends more often than any idle bound.
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                msg = await self._receive_parked()
        except TimeoutError:
            self._dead = self.retired = True
            logger.info("TTS socket to %s idle for %g s: retired", self.url, self._max_idle_s)
            # closed from this task, the socket's only reader (closing from another task while
            # receive() waits would cut the transport: the engine would see 1006)
            await self.ws.close(code=aiohttp.WSCloseCode.OK, message=IDLE_CLOSE_REASON)
            if self._on_retired is not None:
                self._on_retired(self)
            return
        self._dead = True
        if msg.type == aiohttp.WSMsgType.TEXT:  # e.g. an error event: the state is unknown
            logger.info("TTS socket to %s said %r while idle: dropped", self.url, msg.data[:120])
        elif msg.type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                              aiohttp.WSMsgType.CLOSING):  # fmt: skip
            logger.info("TTS socket to %s: %s while idle: dropped", self.url, msg.type.name)
        if not self.ws.closed:
            await self.ws.close()

    async def _receive_parked(self) -> aiohttp.WSMessage:
        """The next message that is not an answer to our keepalive (pings are answered inside
        `receive()`)."""
        while True:
            if self._keepalive_s is None:
                return await self.ws.receive()
            try:
                async with asyncio.timeout(self._keepalive_s):
                    msg = await self.ws.receive()
            except TimeoutError:
                try:
                    await self.ws.send_json({"type": OMNI_INPUT_DONE})
                except asyncio.CancelledError:  # taken mid-send: whether the server counts
                    self._dead = True  # this flush is unknown, so its indices would be too
                    raise
                self.flushes += 1  # the server counts each flush: its events carry the index
                self.keepalives += 1
                continue
            if msg.type == aiohttp.WSMsgType.TEXT and _is_flush_done(msg.data):
                continue  # a keepalive's answer
            return msg


def _is_flush_done(data: str) -> bool:
    try:
        event = json.loads(data)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("type") == OMNI_SESSION_DONE


class SocketPool:
    """Warm sockets per endpoint URL and dialect (`socket_dialects.py`), each in a
    `utils.ConnectionPool`.

    `session()`: the aiohttp session to connect with; `headers`: the engine's auth; `max_idle_s`:
    how long a parked socket waits for an utterance before it is closed. `opened` counts sockets
    opened, `retired` those closed idle (tests and the bench read them)."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], headers: dict[str, str], *,
                 max_idle_s: float = MAX_IDLE_S) -> None:  # fmt: skip
        self._session, self._headers, self._max_idle_s = session, headers, max_idle_s
        self._pools: dict[tuple[str, str], utils.ConnectionPool[WarmSocket]] = {}
        self._settling: dict[str, set[asyncio.Task]] = {}  # per URL: sockets being cancelled
        self._parked: set[WarmSocket] = set()
        self._prewarm: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.opened = self.retired = 0
        self.omni_keepalive_s = OMNI_KEEPALIVE_S  # a parked vLLM-Omni socket's (tests shorten it)
        self._closed = False

    def _pool(self, url: str, protocol: str) -> utils.ConnectionPool[WarmSocket]:
        if (url, protocol) not in self._pools:
            self._pools[(url, protocol)] = utils.ConnectionPool[WarmSocket](
                # no `max_session_duration`: each parked socket's reader retires it on time
                connect_cb=lambda timeout: self._open(url, protocol, timeout), close_cb=self._close,
            )  # fmt: skip
        return self._pools[(url, protocol)]

    async def get(self, url: str, timeout: float, protocol: str = "qwen3-tts") -> WarmSocket:
        """A socket to `url` in `protocol`'s dialect: a parked one that is still open, else a new
        one (raising what a failed connection means for the failover loop: `Stalled`,
        `EngineFull`, ...)."""
        if settling := self._settling.get(url):  # a barge-in's cancel: its socket comes back
            await asyncio.gather(*settling, return_exceptions=True)
        pool = self._pool(url, protocol)
        while True:
            sock = await pool.get(timeout=timeout)
            reused = pool.last_connection_reused  # set by this get(): nothing ran in between
            self._parked.discard(sock)
            if await sock.take():
                sock.reused = reused
                sock.utterances += 1
                return sock
            pool.remove(sock)  # closed by the engine while parked: closed at the next get()

    def put(self, sock: WarmSocket) -> None:
        """Back to the pool: its last utterance ended with `response.done`."""
        if self._closed or not sock.alive:
            self.discard(sock)
            return
        sock.park()
        self._parked.add(sock)
        self._pool(sock.url, sock.protocol).put(sock)

    def parked(self, url: str) -> list[WarmSocket]:
        """The sockets to `url` waiting for an utterance."""
        return [s for s in self._parked if s.url == url]

    def discard(self, sock: WarmSocket) -> None:
        """Never used again: closed now (in the background)."""
        self._pool(sock.url, sock.protocol).remove(sock)
        self._spawn(self._close(sock))

    def cancel(self, sock: WarmSocket, sender: asyncio.Task, bound: float) -> None:
        """A barge-in: once `sender` has stopped, `response.cancel`; the socket goes back when
        the engine answers with `response.done` within `bound` seconds, else (an error, a close,
        no answer) it is discarded. The next `get()` of its endpoint waits for this."""
        task = self._spawn(self._cancel(sock, sender, bound))
        settling = self._settling.setdefault(sock.url, set())
        settling.add(task)
        task.add_done_callback(settling.discard)

    async def _cancel(self, sock: WarmSocket, sender: asyncio.Task, bound: float) -> None:
        await asyncio.gather(sender, return_exceptions=True)
        ws = sock.ws
        try:
            async with asyncio.timeout(bound):
                await ws.send_json({"type": MSG_CANCEL})
                while True:
                    msg = await ws.receive()
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        continue  # audio of the cancelled utterance, still in flight
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        raise ConnectionError(f"closed (code {ws.close_code})")
                    event = json.loads(msg.data)
                    if event.get("type") == EV_ERROR:
                        raise ConnectionError(f"error event {msg.data[:120]}")
                    # `"cancelled": true`; or a plain one: the utterance ended before the cancel
                    # reached the engine, which then drops the cancel (docs/engine-api.md)
                    if event.get("type") == EV_DONE:
                        break
        except (TimeoutError, ConnectionError, aiohttp.ClientError, ValueError) as e:
            logger.info("TTS socket to %s: no answer to response.cancel (%s): closed", sock.url,
                        f"{type(e).__name__}: {e}")  # fmt: skip
            self.discard(sock)
            return
        self.put(sock)

    def prewarm(self, endpoints: EndpointPool, *, ask_engine: bool) -> None:
        """Open a socket to the endpoint the balancer would pick now, unless one is parked there
        (`ask_engine`: only where its status says it takes streamed text)."""
        if not self._closed:
            self._prewarm = self._spawn(self._prewarm_one(endpoints, ask_engine))

    async def prewarmed(self) -> None:
        """Until the last `prewarm()` has opened its socket (or failed: it logs why)."""
        if self._prewarm is not None:
            await asyncio.shield(self._prewarm)

    async def _prewarm_one(self, endpoints: EndpointPool, ask_engine: bool) -> None:
        ep = await endpoints.acquire()
        try:
            # the engine's status says; vLLM-Omni has none: its upgrade says (404: no socket)
            if (
                ask_engine
                and ep.protocol == "qwen3-tts"
                and not await endpoints.streams_text(ep, PREWARM_TIMEOUT_S)
            ):
                return
            if ep.streaming_text is False:
                return
            # a parked socket if there is one, else a new one (still parked: its reader runs)
            sock = await self._pool(ep.url, ep.protocol).get(timeout=PREWARM_TIMEOUT_S)
            self._parked.discard(sock)
            self.put(sock)
        except Exception as e:  # as LiveKit's pool: a failed prewarm leaves the first reply to it
            logger.warning("TTS prewarm of a socket to %s failed: %s: %s", ep.url,
                           type(e).__name__, e)  # fmt: skip
        finally:
            endpoints.release(ep)

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(p.aclose() for p in self._pools.values()), return_exceptions=True)

    async def _open(self, url: str, protocol: str, timeout: float) -> WarmSocket:
        headers = dict(self._headers)
        propagate.inject(headers)  # the engine continues the trace of the utterance that opened it
        ws = await connect(self._session(), url, headers, timeout,
                           DIALECTS[protocol].subprotocols)  # fmt: skip
        self.opened += 1
        keepalive = self.omni_keepalive_s if protocol == "vllm-omni" else None
        return WarmSocket(ws, url, protocol=protocol, max_idle_s=self._max_idle_s,
                          keepalive_s=keepalive, on_retired=self._retire)  # fmt: skip

    def _retire(self, sock: WarmSocket) -> None:
        """A parked socket closed itself, idle: out of the pool now, not at the next get()."""
        self.retired += 1
        self._parked.discard(sock)
        if not self._closed:
            self._pool(sock.url, sock.protocol).remove(sock)

    async def _close(self, sock: WarmSocket) -> None:  # the ConnectionPool's close_cb
        self._parked.discard(sock)
        await sock.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro, name="qwen3-tts-socket-pool")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def connect(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                  timeout: float, subprotocols: tuple[str, ...] = (SPEECH_STREAM_SUBPROTOCOL,),
                  ) -> aiohttp.ClientWebSocketResponse:  # fmt: skip
    """The WebSocket upgrade at `url`'s streaming-text route (`subprotocols`: the dialect's),
    within `timeout`; a failure raised as what it means for the failover loop."""
    ws_url = "ws" + url.removeprefix("http") + SPEECH_STREAM_PATH
    try:
        async with asyncio.timeout(timeout):
            return await session.ws_connect(
                ws_url, protocols=subprotocols, headers=headers,
                # A peer that stops answering pings is found within `timeout` of the last
                # message, in use (the engine may rightly be silent while text is open) or parked.
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
        raise APIStatusError(f"Qwen3-TTS refused the text stream at {url}: HTTP {e.status}",
                             status_code=e.status, body=e.message) from e  # fmt: skip
