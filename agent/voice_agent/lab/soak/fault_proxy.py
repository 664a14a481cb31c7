"""Two small HTTP services of the soak benchmark, on 127.0.0.1: an OpenAI-compatible answerer that
stands in for the LLM (the LLM is not what the soak measures: it speaks the real streaming chat
protocol and answers at once), and a fault-injecting proxy in front of it (the LLM outage)."""

from __future__ import annotations

import json
import time
import uuid

import aiohttp
from aiohttp import web

ANSWER = "Sure, it is noon."
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class StandInLLM:
    """`POST /v1/chat/completions` (streamed or not) answering `ANSWER`; `GET /v1/models`."""

    def __init__(self, answer: str = ANSWER) -> None:
        self.answer, self.requests = answer, 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> StandInLLM:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", lambda _: web.json_response(
            {"object": "list", "data": [{"id": "soak", "object": "model"}]}))  # fmt: skip
        self.runner, self.port = await _serve(app)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body.get("model", "soak")
        if not body.get("stream"):
            return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": self.answer}}]})  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(delta: dict, finish: str | None = None) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        for word in self.answer.split(" "):
            await send({"content": word + " "})
        await send({}, "stop")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FaultProxy:
    """Passes every request through to `upstream` (streamed bodies included), or answers
    500 while an outage lasts (`outage(seconds)`)."""

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

    @property
    def out(self) -> bool:
        return time.monotonic() < self.outage_until

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=16 << 20)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self.runner, self.port = await _serve(app)
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
