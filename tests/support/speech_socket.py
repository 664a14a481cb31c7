"""The engine's streaming-text WebSocket from a test's side: connect, read, speak an utterance
(one copy for the serving and governor tests); `DIALECTS`: every socket dialect's client side. The socket stays open after an utterance's
`response.done` (for the next `session.start`): `until_done` reads one utterance. Every wait is bounded by HANG_GUARD, a bound
only a hang reaches."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import aiohttp
import numpy as np

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.protocol import (
    QWEN_REALTIME_PATH,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
)
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

HANG_GUARD = 180
# A server's socket timeouts far past any hang guard, no heartbeat: for tests of anything but them
PATIENT_SOCKETS = {"ws_first_text_timeout_s": HANG_GUARD * 10, "ws_idle_timeout_s": HANG_GUARD * 10,
                   "ws_keepalive_timeout_s": HANG_GUARD * 10, "ws_heartbeat_s": 0,
                   "ws_send_timeout_s": HANG_GUARD * 10}  # fmt: skip


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


def assert_same_audio(pcm: bytes, reference: bytes) -> None:
    """The same utterance's s16le PCM: as long, equal within rounding (the same codes; where the
    text's pace splits the vocoder's chunks differently, samples differ by rounding only)."""
    assert len(pcm) == len(reference) > 0, (len(pcm), len(reference))
    a, b = (np.frombuffer(x, "<i2").astype(np.int32) for x in (pcm, reference))
    assert np.abs(a - b).max() <= 16


async def until_done(ws: aiohttp.ClientWebSocketResponse) -> list:
    """Every event and chunk of one utterance: up to its `response.done` (the socket stays open),
    or up to an `error` event (then the server's close is read too), or the close."""
    out = []
    while not isinstance(m := await receive(ws), aiohttp.WSMessage):
        out.append(m)
        kind = m.get("type") if isinstance(m, dict) else None
        if kind == "response.done":
            return out
        if kind == "error":
            out += await until_close(ws)
            return out
    return out


async def utterance(
    ws: aiohttp.ClientWebSocketResponse, start: dict, pieces: Iterable[str]
) -> list:
    """One utterance on an open socket: `start`, each piece appended, the end; its events."""
    await ws.send_json(start)
    for piece in pieces:
        await ws.send_json({"type": "input_text.append", "text": piece})
    await ws.send_json({"type": "input_text.end"})
    return await until_done(ws)


async def speak(
    session: aiohttp.ClientSession, api_key: str | None, start: dict, pieces: Iterable[str]
) -> list:
    """One utterance on a socket of its own (closed by the client after it); its events."""
    async with connect(session, api_key) as ws:
        return await utterance(ws, start, pieces)


# -- every socket dialect, for the tests that hold for all of them (tests/engine/serving/
# test_socket_abuse.py): how a client opens an utterance with text, and reads an error's status


@dataclass(frozen=True)
class Dialect:
    name: str  # the metrics' protocol label
    path: str
    protocols: tuple[str, ...]
    start: tuple[dict, ...]  # what opens an utterance (before its text)
    append_type: str  # the message that carries a piece of text
    text_param: str = "text"

    def connect(self, session: aiohttp.ClientSession, api_key: str | None, **kw):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return session.ws_connect(self.path, headers=headers, protocols=self.protocols,
                                  timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD), **kw)  # fmt: skip

    def append(self, text: str) -> dict:
        return {"type": self.append_type, self.text_param: text}

    async def open_text(self, ws, text: str) -> None:
        """An utterance begun with `text`, its text left open."""
        for message in self.start:
            await ws.send_json(message)
        await ws.send_json(self.append(text))

    @staticmethod
    def status(event: dict) -> int | None:
        """An error event's status (each dialect words it in its own place), else None."""
        if event.get("type") != "error":
            return None
        return event["status"] if "status" in event else event["error"]["status"]


DIALECTS = {
    "speech_stream": Dialect(
        "speech_stream", SPEECH_STREAM_PATH, (SPEECH_STREAM_SUBPROTOCOL,),
        ({"type": "session.start", "voice": "ryan", "language": "en", "seed": 3},),
        "input_text.append",
    ),
    "qwen_realtime": Dialect(
        "qwen_realtime", f"{QWEN_REALTIME_PATH}?model=qwen3-tts-flash-realtime", (),
        ({"type": "session.update", "session": {"voice": "ryan", "mode": "server_commit",
                                                "language_type": "English", "seed": 3}},),
        "input_text_buffer.append",
    ),
    "vllm_omni": Dialect(
        "vllm_omni", SPEECH_STREAM_PATH, (),
        ({"type": "session.config", "voice": "ryan", "task_type": "CustomVoice", "language": "English",
          "response_format": "pcm", "stream_audio": True, "seed": 3},),
        "input.text",
    ),
}  # fmt: skip


async def until_error(ws: aiohttp.ClientWebSocketResponse) -> tuple[dict | None, aiohttp.WSMessage]:
    """Read to the server's close: (the error event, if one came, and the close message)."""
    error = None
    while not isinstance(m := await receive(ws), aiohttp.WSMessage):
        if isinstance(m, dict) and m.get("type") == "error":
            error = m
    return error, m
