"""The engine's streaming-text WebSocket from a test's side: connect, read, speak one utterance
(one copy for the serving and governor tests). Every wait is bounded by HANG_GUARD, a bound
only a hang reaches."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable

import aiohttp

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.protocol import SPEECH_STREAM_PATH, SPEECH_STREAM_SUBPROTOCOL
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

HANG_GUARD = 180


@contextlib.asynccontextmanager
async def engine_server(checkpoint: str, max_batch: int, **config) -> AsyncIterator[EngineServer]:
    """An in-process engine server on 127.0.0.1 (any port): one handler of `max_batch` rows over
    `checkpoint`, `config` its ServerConfig fields; stopped on exit."""
    server = EngineServer(Engine(checkpoint, [Handler(checkpoint, max_batch=max_batch)]),
                          ServerConfig(port=0, **config))  # fmt: skip
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def client_session(server: EngineServer) -> aiohttp.ClientSession:
    """An aiohttp session with the server's base URL (use with `async with`)."""
    return aiohttp.ClientSession(f"http://127.0.0.1:{server.port}")


def connect(session: aiohttp.ClientSession, api_key: str | None, **kw):
    """`session.ws_connect` to the streaming-text route (an async context manager, or awaited)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return session.ws_connect(SPEECH_STREAM_PATH, headers=headers, protocols=(SPEECH_STREAM_SUBPROTOCOL,),
                              timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD), **kw)  # fmt: skip


async def receive(ws: aiohttp.ClientWebSocketResponse):
    """The next message: a JSON event as a dict, audio as bytes, anything else (a close, a pong)
    as aiohttp's WSMessage."""
    m = await asyncio.wait_for(ws.receive(), HANG_GUARD)
    if m.type == aiohttp.WSMsgType.TEXT:
        return json.loads(m.data)
    return m.data if m.type == aiohttp.WSMsgType.BINARY else m


async def until_close(ws: aiohttp.ClientWebSocketResponse) -> list:
    """Every event and chunk until the server closes."""
    out = []
    while not isinstance(m := await receive(ws), aiohttp.WSMessage):
        out.append(m)
    return out


async def speak(
    session: aiohttp.ClientSession, api_key: str | None, start: dict, pieces: Iterable[str]
) -> list:
    """One utterance: `start`, each piece appended, the end; every event and chunk after."""
    async with connect(session, api_key) as ws:
        await ws.send_json(start)
        for piece in pieces:
            await ws.send_json({"type": "input_text.append", "text": piece})
        await ws.send_json({"type": "input_text.end"})
        return await until_close(ws)
