"""An OpenAI-compatible chat server on loopback that speaks the real streaming protocol (SSE).

It stands in for the LLM only (no useful instruct model can be had offline): the first turn asks
for the `get_current_time` tool, and after the tool's result it answers with scripted text.
"""

from __future__ import annotations

import json
import time

from aiohttp import web


class ScriptedChatServer:
    def __init__(self, answer: str = "It is noon. Anything else I can do for you?", *,
                 use_tool: bool = True, fail: bool = False, echo: bool = False,
                 tool_rules: dict[str, str] | None = None) -> None:  # fmt: skip
        self.answer = answer
        # {words in the last user message: the tool to call}: e.g. {"pressed 7": "end_call"}
        self.tool_rules = {k.lower(): v for k, v in (tool_rules or {}).items()}
        self.echo = echo  # answer "You said: <the last user message>." (which request a reply answers)
        self.use_tool = use_tool
        self.fail = fail
        self.requests: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> ScriptedChatServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    def _rule_tool(self, body: dict) -> str | None:
        """The tool a rule asks for: the last user message matches, and no tool has answered since."""
        messages = body["messages"]
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
        if last_user is None or any(m.get("role") == "tool" for m in messages[last_user:]):
            return None
        text = _text(messages[last_user].get("content")).lower()
        offered = {t.get("function", {}).get("name") for t in body.get("tools") or []}
        for words, tool in self.tool_rules.items():
            if words in text and tool in offered:
                return tool
        return None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": "scripted", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n".encode()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail:
            return web.json_response({"error": {"message": "model overloaded"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        had_tool_result = any(m.get("role") == "tool" for m in body["messages"])
        tool = self._rule_tool(body)
        if tool is None and self.use_tool and body.get("tools") and not had_tool_result:
            tool = "get_current_time"
        if tool is not None:
            call = {"index": 0, "id": f"call_{len(self.requests)}", "type": "function",
                    "function": {"name": tool, "arguments": "{}"}}  # fmt: skip
            await resp.write(self._chunk({"role": "assistant", "tool_calls": [call]}))
            await resp.write(self._chunk({}, "tool_calls"))
        else:
            await resp.write(self._chunk({"role": "assistant", "content": ""}))
            answer = self.answer
            if self.echo:
                users = [m for m in body["messages"] if m.get("role") == "user"]
                heard = users[-1]["content"] if users else ""
                heard = _text(heard)
                answer = f"You said: {heard.strip().rstrip('.?!')}."
            for word in answer.split():
                await resp.write(self._chunk({"content": word + " "}))
            await resp.write(self._chunk({}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _text(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts."""
    if content is None:
        return ""
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
