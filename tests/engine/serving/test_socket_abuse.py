"""The WebSocket holds against abuse, not only bad messages (issue 43 item 7): compressed frames
that would inflate past the limits, floods of tiny appends or pings, deeply nested JSON,
fragmented and malformed frames, huge or countless start fields, error messages that would
echo megabytes, many upgrades at once. Each is bounded (memory, count), ends that client with a
documented error event or close code, and leaves the worker (its pid) and a neighbour's
utterance alone. Raw frames are written by hand where a client library would refuse to.
The session core's limits hold for every dialect (ours, the hosted Qwen realtime, vLLM-Omni's;
issue 50): the idle limit under the heartbeat, a 3 MB message (peak memory), the backlog, close
reasons, upgrades reset at once.
Real sockets on 127.0.0.1; no check depends on the machine's speed."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import struct
import zlib

import aiohttp
import numpy as np
import psutil
import pytest

from qwen3_tts_engine.protocol import MAX_ERROR_CHARS, SPEECH_STREAM_PATH, SPEECH_STREAM_SUBPROTOCOL
from tests.support.speech_socket import (
    DIALECTS,
    HANG_GUARD,
    client_session,
    connect,
    engine_server,
    receive,
    speak,
    until_error,
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


# -- every dialect (ours, the hosted Qwen realtime, vLLM-Omni's): the core's limits hold for each --

ALL = pytest.mark.parametrize("dialect", DIALECTS.values(), ids=list(DIALECTS))
PEAK_BOUND = 150 << 20  # peak growth of the server process under one 3 MB message


def _reset_peak() -> int:
    """Reset the process's peak RSS (Linux: clear_refs 5); its RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return psutil.Process().memory_info().rss


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


async def _load(session) -> dict:
    return await (await session.get("/load")).json()


async def _until_gone(session) -> None:
    async with asyncio.timeout(HANG_GUARD):
        while (load := await _load(session))["sessions"] or load["running"] or load["waiting"]:
            await asyncio.sleep(0.05)


@ALL
async def test_a_silent_stream_with_open_text_ends_at_the_idle_limit_despite_the_heartbeat(
    server, session, monkeypatch, dialect
):
    """The heartbeat on and shorter than the idle limit (its pongs are no messages): the client
    answers every ping and says nothing else; the idle limit ends it with a 408 and /load shows
    it gone."""
    monkeypatch.setattr(server.config, "ws_heartbeat_s", 0.3)
    monkeypatch.setattr(server.config, "ws_idle_timeout_s", 1.5)
    async with dialect.connect(session, API_KEY, autoping=False) as ws:
        await dialect.open_text(ws, "Hello there, and then")
        error, pings = None, 0
        while (m := await asyncio.wait_for(ws.receive(), HANG_GUARD)).type not in (
            aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):  # fmt: skip
            if m.type == aiohttp.WSMsgType.PING:
                pings += 1
                await ws.pong(m.data)
            elif m.type == aiohttp.WSMsgType.TEXT and json.loads(m.data)["type"] == "error":
                error = json.loads(m.data)
    assert error is not None and dialect.status(error) == 408, error
    assert "ws_idle_timeout_s" in json.dumps(error) and m.data == 1008 and pings >= 2, (m, pings)
    await _until_gone(session)


async def _post(session) -> int:
    body = {"input": "Hello.", "voice": "ryan", "response_format": "pcm"}
    async with session.post("/v1/audio/speech", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
        await r.read()
        return r.status


@ALL
async def test_a_3mb_message_of_short_sentences_is_refused_at_once_with_a_post_beside_it(
    server, session, dialect, bounded
):
    """One message holds no more text than an utterance (POST's 400 for a long input): nothing
    is cut or queued; the peak growth of the server stays small; a POST beside it is served."""
    text = "Hi. " * ((3 << 20) // 4)
    base = _reset_peak()
    async with dialect.connect(session, API_KEY) as ws:
        for message in dialect.start:
            await ws.send_json(message)
        posted = asyncio.create_task(_post(session))
        await ws.send_str(json.dumps(dialect.append(text)))
        error, closed = await until_error(ws)
        assert await posted == 200
    assert dialect.status(error) == 400 and "longer than" in json.dumps(error), error
    assert closed.data == 1008
    assert _peak() - base < PEAK_BOUND, (_peak() - base) >> 20


@pytest.mark.parametrize("dialect", [DIALECTS["qwen_realtime"], DIALECTS["vllm_omni"]],
                         ids=["qwen_realtime", "vllm_omni"])  # fmt: skip
async def test_a_message_of_short_sentences_queues_a_bounded_backlog(server, session, dialect):
    """Where sentences wait their turn (the hosted server_commit, vLLM-Omni's sentence split), a
    message of a thousand sentences queues at most ws_max_pending of them: the rest joins the
    last one, bounded by max_input_chars. Closing the socket drops them all."""
    limit = server.config.limits.max_input_chars
    async with dialect.connect(session, API_KEY) as ws:
        for message in dialect.start:
            await ws.send_json({**message, "split_granularity": "sentence"}
                               if message["type"] == "session.config" else message)  # fmt: skip
        await ws.send_str(json.dumps(dialect.append("Hi. " * (limit // 4))))
        async with asyncio.timeout(HANG_GUARD):  # the message was read: its backlog exists
            while not [s for s in server.sockets.sessions
                       if getattr(s, "backlog", None) is not None and s.backlog.waiting]:  # fmt: skip
                await asyncio.sleep(0.02)
        [sock] = [s for s in server.sockets.sessions if getattr(s, "backlog", None) is not None]
        texts = [i.text for i in sock.backlog.items if hasattr(i, "text")]
        assert len(texts) == sock.backlog.waiting <= server.config.ws_max_pending
        assert texts[-1] is sock.backlog.open.text and texts[-1].chars > 100 * 4  # joined
        assert sum(t.chars for t in texts) <= limit
    await _until_gone(session)


@ALL
async def test_a_close_reason_is_valid_utf8_within_the_frame_for_any_error(
    server, session, dialect
):
    """An error with non-ASCII text closes with 1008 and a reason of at most 123 bytes of valid
    UTF-8 (a reason cut inside a character made the client see 1002)."""
    async with dialect.connect(session, API_KEY) as ws:
        for message in dialect.start:
            await ws.send_json(message)
        await ws.send_json({"type": "ü日" * 300})
        error, closed = await until_error(ws)
    assert dialect.status(error) == 400
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1008, closed
    assert 0 < len(closed.extra.encode()) <= 123 and "日" in closed.extra


async def _reset_upgrade(server, dialect) -> None:
    """An upgrade request, then a reset (SO_LINGER 0) before its answer is read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    protocol = f"Sec-WebSocket-Protocol: {dialect.protocols[0]}\r\n" if dialect.protocols else ""
    writer.write((f"GET {dialect.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"{protocol}Authorization: Bearer {API_KEY}\r\n\r\n").encode())  # fmt: skip
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@ALL
async def test_upgrades_reset_at_once_leave_no_traceback(server, session, dialect, caplog):
    caplog.set_level(logging.INFO)
    await asyncio.gather(*(_reset_upgrade(server, dialect) for _ in range(300)))
    await _until_gone(session)
    events = await speak(session, API_KEY, START, ["Hello there."])  # still serving
    assert events[-1]["type"] == "response.done"
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks[:3]]
