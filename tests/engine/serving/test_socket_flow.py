"""Flow control on the sockets (issue 50 item 2, the socket's side): a stream never runs more
than `ws_ahead_s` of audio ahead of what its client has taken. A client whose receive buffer is
small stops reading: the pump stops taking audio from the engine (it holds), a POST beside it is
served whole meanwhile and the held stream makes no more audio; once the client reads, the
utterance resumes and ends whole. Real sockets on 127.0.0.1; order by events, never by time."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket

import numpy as np
import pytest

from qwen3_tts_engine.protocol import SPEECH_STREAM_PATH, SPEECH_STREAM_SUBPROTOCOL
from tests.support.speech_socket import HANG_GUARD, PATIENT_SOCKETS, client_session, engine_server

pytestmark = pytest.mark.slow
API_KEY = "flow-key"
AHEAD_S = 0.5
CHUNK_BYTES = 4 * 1920 * 2  # a 4-frame chunk of 24 kHz s16le
READER_LIMIT = 4096
TEXT = "Hello there, how are you today? I hope the weather is fine where you are, my friend."


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(checkpoint, 2, api_key=API_KEY, ws_ahead_s=AHEAD_S,
                             **PATIENT_SOCKETS) as srv:  # fmt: skip
        yield srv


def _frame(payload: bytes) -> bytes:
    """A masked client text frame."""
    n, mask = len(payload), os.urandom(4)
    head = bytes([0x81]) + (
        bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    )
    data = np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)
    return head + mask + data.tobytes()


async def _slow_reader(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """An upgraded socket whose receive buffers are small (so what it does not read stays in
    the server's send queue), and what they hold at most (the kernel's, asyncio's)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    # a small reader limit: asyncio stops reading the socket once that much waits unread
    reader, writer = await asyncio.open_connection(sock=sock, limit=READER_LIMIT)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {SPEECH_STREAM_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Sec-WebSocket-Protocol: {SPEECH_STREAM_SUBPROTOCOL}\r\n"
                  f"Authorization: Bearer {API_KEY}\r\n\r\n").encode())  # fmt: skip
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) + 2 * READER_LIMIT


async def _frames(reader: asyncio.StreamReader):
    """The server's frames: (opcode, payload), until the socket ends."""
    while True:
        b0, b1 = await asyncio.wait_for(reader.readexactly(2), HANG_GUARD)
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(await reader.readexactly(2), "big")
        elif n == 127:
            n = int.from_bytes(await reader.readexactly(8), "big")
        yield b0 & 0x0F, await reader.readexactly(n)


async def test_a_client_that_stops_reading_holds_its_stream_and_it_resumes_when_read(server):
    reader, writer, rcvbuf = await _slow_reader(server)
    start = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
    for message in (start, {"type": "input_text.append", "text": TEXT}, {"type": "input_text.end"}):
        writer.write(_frame(json.dumps(message).encode()))
    await writer.drain()
    async with asyncio.timeout(HANG_GUARD):  # the pump holds: its client has not read
        while not (held := [s.utterance for s in server.sockets.sessions
                            if s.utterance is not None and s.utterance.holds]):  # fmt: skip
            ended = [s for s in server.sockets.sessions if s.utterance and s.utterance.settled]
            assert not ended, "the utterance ended without its stream holding (no flow control?)"
            await asyncio.sleep(0.02)
    [utt] = held
    made = utt.samples * 2
    ahead = AHEAD_S * utt.req.sample_rate * 2
    assert made <= ahead + rcvbuf + 2 * CHUNK_BYTES, (made, ahead, rcvbuf)
    # meanwhile a POST is served whole, and the held stream takes no more audio
    async with client_session(server) as http:
        async with http.post("/v1/audio/speech", headers={"Authorization": f"Bearer {API_KEY}"},
                             json={"input": "Hello.", "voice": "ryan", "response_format": "pcm"}) as r:  # fmt: skip
            assert r.status == 200 and len(await r.read()) > 0
    assert utt.samples * 2 == made and not utt.settled
    # the client reads: the utterance resumes and ends whole
    pcm, done = 0, None
    async for opcode, payload in _frames(reader):
        if opcode == 0x2:
            pcm += len(payload)
        elif opcode == 0x1 and (event := json.loads(payload))["type"] == "response.done":
            done = event
            break
    writer.close()
    assert done is not None and done["finish_reason"] == "stop" and utt.holds >= 1
    assert pcm == done["samples"] * 2 > made
