"""An OpenAI-compatible chat server on loopback that speaks the real streaming protocol (SSE).

It stands in for the LLM where the LLM is not what is measured or tested (no useful instruct model
can be had offline): the tests script it (ask for the `get_current_time` tool first, answer with
given text after the tool's result, call a tool when the caller says given words, echo, fail),
and the soak benchmark lets it answer at once, always the same words. Paced (`pace`), it writes
its answer as an LLM does, token by token at a fixed rate after a first-token delay (asyncio
sleeps: no CPU), for the agent bench to time the pipeline without an LLM's own cost.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

from aiohttp import web


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve `app` on 127.0.0.1, any free port: (its runner, to clean up; the port)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class ScriptedChatServer:
    """`POST /v1/chat/completions` (streamed, or one JSON body when the request does not ask for
    a stream) and `GET /v1/models` (one model, `model`)."""

    def __init__(self, answer: str = "It is noon. Anything else I can do for you?", *,
                 use_tool: bool = True, fail: bool = False, echo: bool = False,
                 tool_rules: dict[str, str] | None = None, model: str = "scripted",
                 keep_requests: bool = True, pace: float | None = None,
                 first_token_s: float = 0.0) -> None:  # fmt: skip
        self.answer = answer
        # tokens a second (None: all at once) and the wait before the first (from the request)
        self.pace, self.first_token_s = pace, first_token_s
        self.first_token_at: list[float] = []  # perf_counter of each answer's first token sent
        # {words in the last user message: the tool to call}: e.g. {"pressed 7": "end_call"}
        self.tool_rules = {k.lower(): v for k, v in (tool_rules or {}).items()}
        self.echo = (
            echo  # answer "You said: <the last user message>." (which request a reply answers)
        )
        self.use_tool = use_tool
        self.fail = fail
        self.model = model
        self.keep_requests = (
            keep_requests  # False: count them only (a long run's memory stays flat)
        )
        self.requests: list[dict] = []
        self.request_count = 0
        self._waiters: list[tuple[Callable[[dict], bool], asyncio.Future]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> ScriptedChatServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self.runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def request_where(self, match: Callable[[dict], bool]) -> dict:
        """The first request (its body) that `match`es, once one has arrived (an event, no
        polling; the caller bounds the wait). Needs `keep_requests`."""
        for body in self.requests:
            if match(body):
                return body
        waiter = (match, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            return await waiter[1]
        finally:
            self._waiters.remove(waiter)

    def _rule_tool(self, body: dict) -> str | None:
        """The tool a rule asks for: the last user message matches, and no tool has answered since."""
        messages = body["messages"]
        last_user = max(
            (i for i, m in enumerate(messages) if m.get("role") == "user"), default=None
        )
        if last_user is None or any(m.get("role") == "tool" for m in messages[last_user:]):
            return None
        text = _text(messages[last_user].get("content")).lower()
        offered = {t.get("function", {}).get("name") for t in body.get("tools") or []}
        for words, tool in self.tool_rules.items():
            if words in text and tool in offered:
                return tool
        return None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n".encode()

    def answer_to(self, body: dict) -> str:
        """The text this server answers a request (without a tool call) with."""
        if not self.echo:
            return self.answer
        return f"You said: {last_user_text(body).strip().rstrip('.?!')}."

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.request_count += 1
        if self.keep_requests:
            self.requests.append(body)
            for match, fut in self._waiters:
                if not fut.done() and match(body):
                    fut.set_result(body)
        if self.fail:
            return web.json_response({"error": {"message": "model overloaded"}}, status=500)
        had_tool_result = any(m.get("role") == "tool" for m in body["messages"])
        tool = self._rule_tool(body)
        if tool is None and self.use_tool and body.get("tools") and not had_tool_result:
            tool = "get_current_time"
        if not body.get("stream", True):
            return self._whole(tool, body)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            await self._stream(resp, tool, body)
        except ConnectionResetError:  # the client went away (a cancelled generation): done
            pass
        return resp

    async def _stream(self, resp: web.StreamResponse, tool: str | None, body: dict) -> None:
        if tool is not None:
            call = {"index": 0, "id": f"call_{self.request_count}", "type": "function",
                    "function": {"name": tool, "arguments": "{}"}}  # fmt: skip
            await resp.write(self._chunk({"role": "assistant", "tool_calls": [call]}))
            await resp.write(self._chunk({}, "tool_calls"))
        else:
            await resp.write(self._chunk({"role": "assistant", "content": ""}))
            if self.pace:
                await self._paced(resp, self.answer_to(body))
            else:
                for word in self.answer_to(body).split():
                    await resp.write(self._chunk({"content": word + " "}))
            await resp.write(self._chunk({}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def _paced(self, resp: web.StreamResponse, text: str) -> None:
        """`text` as BPE-like tokens (a word with its leading space, punctuation apart), the
        first after `first_token_s`, then one every 1/`pace` s (from the first: no drift)."""
        await asyncio.sleep(self.first_token_s)
        t0 = time.perf_counter()
        for i, token in enumerate(llm_tokens(text)):
            await asyncio.sleep(max(0.0, t0 + i / self.pace - time.perf_counter()))
            await resp.write(self._chunk({"content": token}))
            if i == 0:
                self.first_token_at.append(time.perf_counter())

    def _whole(self, tool: str | None, body: dict) -> web.Response:
        """The answer as one `chat.completion` (a request with `"stream": false`)."""
        if tool is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{self.request_count}", "type": "function",
                 "function": {"name": tool, "arguments": "{}"}}]}  # fmt: skip
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": self.answer_to(body)}, "stop"
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
                                  "model": self.model,
                                  "choices": [{"index": 0, "finish_reason": finish, "message": message}]})  # fmt: skip


def llm_tokens(text: str) -> list[str]:
    """`text` cut as a BPE tokenizer roughly does: words with their leading space, punctuation
    apart ("Sure, it" -> "Sure", ",", " it"); joined, the tokens are `text`."""
    return re.findall(r"\s*[\w']+|\s*[^\w\s']+|\s+$", text)


def last_user_text(body: dict) -> str:
    """The text of a chat request's last user message ("" if it has none)."""
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    return _text(users[-1].get("content")) if users else ""


def _text(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts."""
    if content is None:
        return ""
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
