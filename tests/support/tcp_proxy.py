"""A small TCP proxy on 127.0.0.1 that injects network faults, in place of the toxiproxy container
LiveKit's own plugin tests use: it passes bytes, stalls, cuts a connection, or answers an empty 200.

A fault applies to the connections accepted after it is set (`times=n`: only to the next n, then
the fault set before it applies again); `set()` closes the connections already open, so a pooled
keep-alive connection cannot dodge it. `stalled_at` is the loop time at which the last stall began
(after some bytes: when the last of them was written, so the client read none of them sooner).
`after` counts the response bytes let through past the end of the response head (HTTP);
`after=None` lets nothing through at all.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Literal

Mode = Literal["pass", "stall", "cut", "empty200"]
EMPTY_200 = (b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nContent-Length: 0\r\n"
             b"Connection: close\r\n\r\n")  # fmt: skip


@dataclass(frozen=True)
class Fault:
    mode: Mode = "pass"
    after: int | None = (
        None  # response body bytes let through first (None: none, not even the head)
    )


class TcpProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.accepted = 0  # connections accepted so far
        self.stalled_at: float | None = None
        self._fault = Fault()
        self._next: list[Fault] = []  # faults for the next connections, in turn
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def set(self, mode: Mode, *, after: int | None = None, times: int | None = None) -> None:
        fault = Fault(mode, after)
        if times is not None:
            self._next = [fault] * times
        else:
            self._fault, self._next = fault, []
        for writer in list(self._writers):  # open connections do not keep the old behaviour
            writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        self.accepted += 1
        fault = self._next.pop(0) if self._next else self._fault
        upstream_writer = None
        try:
            if fault.mode == "empty200":
                await reader.read(65536)  # the request's head, at least
                writer.write(EMPTY_200)
                await writer.drain()
                return
            if fault.after is None and fault.mode == "stall":
                self.stalled_at = asyncio.get_running_loop().time()
                await _drain_until_eof(reader)  # accepts, reads, never answers
                return
            if fault.after is None and fault.mode == "cut":
                await reader.read(65536)
                return
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(upstream_writer)
            up = asyncio.ensure_future(_pump(reader, upstream_writer))
            down = asyncio.ensure_future(self._respond(upstream_reader, writer, fault))
            try:
                # a stalled response never ends: the client hanging up (its timeout) ends it
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # aclose(): ends quietly (asyncio's server logs a handler that ends cancelled)
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
            self._handlers.discard(task)

    async def _respond(
        self, upstream: asyncio.StreamReader, client: asyncio.StreamWriter, fault: Fault
    ) -> None:
        """Copy the response to the client; with a fault, only the head and `after` body bytes."""
        head, body_sent, in_body = b"", 0, False
        last_write: float | None = None  # loop time of the last write of body bytes
        while data := await upstream.read(65536):
            if fault.mode == "pass":
                client.write(data)
                await client.drain()
                continue
            if not in_body:
                head += data
                end = head.find(b"\r\n\r\n")
                if end < 0:
                    client.write(data)
                    await client.drain()
                    continue
                in_body = True
                data = head[end + 4 :]
                client.write(head[: end + 4])
            allowed = max(0, fault.after - body_sent)
            last_write = asyncio.get_running_loop().time()  # the client reads these bytes after it
            client.write(data[:allowed])
            await client.drain()
            body_sent += min(len(data), allowed)
            if body_sent >= fault.after:
                break
        if fault.mode == "stall":
            # the stall began with the last write: the client's last read comes after it
            self.stalled_at = (
                last_write if last_write is not None else asyncio.get_running_loop().time()
            )
            await asyncio.Event().wait()  # nothing more comes


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    while data := await src.read(65536):
        dst.write(data)
        await dst.drain()


async def _drain_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass
