"""The soak benchmark's LLM outage: a proxy on 127.0.0.1 in front of the LLM (stand-in) that
passes every request through, or answers 500 while an outage lasts."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from voice_agent.harness.openai_stand_in import serve_on_loopback

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


class FaultProxy:
    """Passes every request through to `upstream` (streamed bodies included), or answers
    500 while an outage lasts (`outage(seconds)`, or until `end_outage()`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")  # http://host:port (no path)
        self.outage_until = 0.0
        self.passed = self.refused = 0
        self.runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def outage(self, seconds: float) -> None:
        self.outage_until = time.monotonic() + seconds

    def end_outage(self) -> None:
        self.outage_until = 0.0

    @property
    def out(self) -> bool:
        return time.monotonic() < self.outage_until

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        app = web.Application(client_max_size=16 << 20)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self.runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if self.out:
            self.refused += 1
            return web.json_response({"error": {"message": "injected outage (soak benchmark)",
                                                "type": "server_error", "code": 500}}, status=500)  # fmt: skip
        self.passed += 1
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(request.method, f"{self.upstream}{request.rel_url}",
                                         data=await request.read(), headers=headers) as up:  # fmt: skip
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in HOP_HEADERS})  # fmt: skip
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp
