"""The WebSocket holds against abuse, not only bad messages (issue 43 item 7): compressed frames
that would inflate past the limits, floods of tiny appends or pings, deeply nested JSON,
fragmented and malformed frames, huge or countless start fields, error messages that would
echo megabytes, many upgrades at once. Each is bounded (memory, count), ends that client with a
documented error event or close code, and leaves the worker (its pid) and a neighbour's
utterance alone. Raw frames are written by hand where a client library would refuse to.
Real sockets on 127.0.0.1; no check depends on the machine's speed."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import zlib

import aiohttp
import numpy as np
import psutil
import pytest

from qwen3_tts_engine.protocol import MAX_ERROR_CHARS, SPEECH_STREAM_PATH, SPEECH_STREAM_SUBPROTOCOL
from tests.support.speech_socket import (
    HANG_GUARD,
    client_session,
    connect,
    engine_server,
    receive,
    speak,
)

pytestmark = pytest.mark.slow
API_KEY = "abuse-key"
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
MEMORY_BOUND = 100 << 20  # what one abusive client may add to the server process, at most
TEXT, BINARY, CLOSE, PING = 0x1, 0x2, 0x8, 0x9


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(checkpoint, 2, api_key=API_KEY, ws_max_messages=2000, ws_heartbeat_s=0,
                             ws_first_text_timeout_s=HANG_GUARD * 10,
                             ws_idle_timeout_s=HANG_GUARD * 10) as srv:  # fmt: skip
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


@pytest.fixture
async def bounded(server, session):
    """Around each abuse: the worker's pid stays, the server process grows by less than
    MEMORY_BOUND, and a neighbour's utterance is served to its end afterwards."""
    pid = server.engine.active.pid
    rss = psutil.Process().memory_info().rss
    yield
    assert psutil.Process().memory_info().rss - rss < MEMORY_BOUND
    events = await speak(session, API_KEY, START, ["Hello there."])
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0
    assert server.engine.active.pid == pid and server.engine.active.restarts == 0


async def _refused(ws, status: int) -> dict:
    """The error event (skipping what came before it), then a 1008 close."""
    while not (isinstance(event := await receive(ws), dict) and event["type"] == "error"):
        assert not isinstance(event, aiohttp.WSMessage), f"closed without an error event: {event}"
    assert event["status"] == status, event
    closed = await receive(ws)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1008, closed
    return event


# -- raw frames (RFC 6455) ------------------------------------------------------------------


async def _raw(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {SPEECH_STREAM_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Sec-WebSocket-Protocol: {SPEECH_STREAM_SUBPROTOCOL}\r\n"
                  "Sec-WebSocket-Extensions: permessage-deflate\r\n"
                  f"Authorization: Bearer {API_KEY}\r\n\r\n").encode())  # fmt: skip
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD)
    assert head.startswith(b"HTTP/1.1 101"), head
    assert b"permessage-deflate" not in head.lower()  # compression is never agreed
    return reader, writer


def _frame(payload: bytes, opcode: int = TEXT, *, fin: bool = True, rsv1: bool = False) -> bytes:
    """A masked client frame."""
    head = bytes([(0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    data = np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)
    return head + mask + data.tobytes()


async def _frames_until_close(
    reader: asyncio.StreamReader,
) -> tuple[list[tuple[int, bytes]], int | None]:
    """The server's frames up to its close: [(opcode, payload)], and the close code (None: the
    connection ended without a close frame)."""
    frames = []
    while True:
        try:
            b0, b1 = await asyncio.wait_for(reader.readexactly(2), HANG_GUARD)
        except asyncio.IncompleteReadError:
            return frames, None
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(await reader.readexactly(2), "big")
        elif n == 127:
            n = int.from_bytes(await reader.readexactly(8), "big")
        payload = await reader.readexactly(n)
        if b0 & 0x0F == CLOSE:
            return frames, int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
        frames.append((b0 & 0x0F, payload))


# -- the abuses ------------------------------------------------------------------------------


async def test_a_compressed_frame_is_never_inflated(server, bounded):
    """A deflate bomb (64 MiB of zeros in ~64 KB): compression was not agreed, so a frame with
    RSV1 set is a protocol error (1002) and is never inflated."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = squeeze.compress(b"\0" * (64 << 20)) + squeeze.flush(zlib.Z_SYNC_FLUSH)
    reader, writer = await _raw(server)
    writer.write(_frame(json.dumps(START).encode()))
    writer.write(_frame(bomb[:-4], rsv1=True))
    await writer.drain()
    frames, code = await _frames_until_close(reader)
    writer.close()
    assert code == 1002, (frames, code)


async def test_floods_of_tiny_appends_or_pings_end_the_session(server, session, bounded):
    limit = server.config.ws_max_messages
    async with connect(session, API_KEY) as ws:
        await ws.send_json(START)
        for _ in range(limit + 10):
            await ws.send_json({"type": "input_text.append", "text": ""})
        event = await _refused(ws, 429)
        assert "ws_max_messages" in event["error"]["message"]
    async with connect(session, API_KEY, autoping=False) as ws:
        await ws.send_json(START)
        for _ in range(limit + 10):
            await ws.ping(b"x")
        pongs = 0
        while not (isinstance(event := await receive(ws), dict) and event["type"] == "error"):
            assert (
                not isinstance(event, aiohttp.WSMessage) or event.type == aiohttp.WSMsgType.PONG
            ), event
            pongs += isinstance(event, aiohttp.WSMessage)
        assert event["status"] == 429 and 0 < pongs < limit + 10, (event, pongs)


async def test_deeply_nested_or_unparsable_json_is_a_400(server, session, bounded):
    for junk in ("[" * 100_000 + "]" * 100_000, '{"type": ' + "1" * 10_000 + "}", "{" * 50_000):
        async with connect(session, API_KEY) as ws:
            await ws.send_str(junk)
            event = await _refused(ws, 400)
            assert "JSON" in event["error"]["message"]


async def test_fragmented_frames_are_one_message_and_malformed_ones_a_protocol_error(
    server, bounded
):
    reader, writer = await _raw(server)
    start = json.dumps(START).encode()
    writer.write(_frame(start[:10], TEXT, fin=False) + _frame(start[10:20], 0x0, fin=False)
                 + _frame(start[20:], 0x0, fin=True))  # fmt: skip
    await writer.drain()
    frames, code = [], None
    while not frames:  # the whole message was read: session.created
        b0, b1 = await asyncio.wait_for(reader.readexactly(2), HANG_GUARD)
        frames.append(json.loads(await reader.readexactly(b1 & 0x7F)))
    assert frames[0]["type"] == "session.created"
    writer.write(_frame(b"stray", 0x0, fin=True))  # a continuation with no message to continue
    await writer.drain()
    _, code = await _frames_until_close(reader)
    writer.close()
    assert code == 1002
    # a reserved opcode: a protocol error; an unmasked frame aiohttp reads as any other (here: not JSON)
    for bad, expected in ((_frame(b"x", 0x3), 1002), (bytes([0x81, 0x05]) + b"hello", 1008)):
        reader, writer = await _raw(server)
        writer.write(bad)
        await writer.drain()
        _, code = await _frames_until_close(reader)
        writer.close()
        assert code == expected, bad


async def test_huge_or_countless_start_fields_are_refused(server, session, bounded):
    async with connect(session, API_KEY) as ws:
        await ws.send_json({**START, **{f"field{i}": i for i in range(10_000)}})
        event = await _refused(ws, 400)
        assert "fields" in event["error"]["message"]
    # a frame over the size limit: closed with 1009 (aiohttp) from its header, before its payload
    reader, writer = await _raw(server)
    size = server.config.max_body_bytes + 1
    writer.write(bytes([0x81, 0x80 | 127]) + size.to_bytes(8, "big") + os.urandom(4) + b"{" * 1000)
    await writer.drain()
    _, code = await _frames_until_close(reader)
    writer.close()
    assert code == 1009


async def test_an_error_never_echoes_megabytes(server, session, bounded):
    async with connect(session, API_KEY) as ws:
        await ws.send_json({"type": "x" * (2 << 20)})
        event = await _refused(ws, 400)
        assert len(event["error"]["message"]) <= MAX_ERROR_CHARS
    async with connect(session, API_KEY) as ws:
        await ws.send_json({**START, "voice": "v" * (2 << 20)})
        event = await _refused(ws, 400)
        assert (
            len(event["error"]["message"]) <= MAX_ERROR_CHARS and event["error"]["param"] == "voice"
        )


async def test_many_upgrades_at_once_are_capped(server, session, monkeypatch, bounded):
    monkeypatch.setattr(server.config, "max_sessions", 20)

    async def upgrade():
        try:
            return await connect(session, API_KEY)
        except aiohttp.WSServerHandshakeError as e:
            return e.status

    answers = await asyncio.gather(*(upgrade() for _ in range(60)))
    opened = [a for a in answers if not isinstance(a, int)]
    assert len(opened) == 20 and sorted(set(a for a in answers if isinstance(a, int))) == [429]
    for ws in opened:
        await ws.close()
