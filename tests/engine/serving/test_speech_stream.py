"""The streaming-text WebSocket route over real sockets on 127.0.0.1 (worker processes, the
tiny checkpoint whose utterances end by EOS). Order is shown by the messages' order on the
socket and by the engine's state, never by time."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket

import aiohttp
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    Limits,
)
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig
from qwen3_tts_engine.worker.incremental_text import text_token_ids
from tests.support.speech_socket import until_close, until_done

pytestmark = pytest.mark.slow
API_KEY = "ws-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Hello there, how are you?"
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
HANG_GUARD = 120
LIMIT = 1000  # the engine's max_input_chars in these tests
LONG_TEXT = ("A long reply that goes on and on, " * 30)[:LIMIT]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("custom_voice", eos="text"))


@pytest.fixture(scope="module")
async def server(checkpoint):
    engine = Engine(checkpoint, [Handler(checkpoint, max_batch=4)])
    # a send timeout past the hang guard: only the send buffer's bound can drop a stuck client
    config = ServerConfig(port=0, api_key=API_KEY, limits=Limits(max_input_chars=LIMIT),
                          ws_send_timeout_s=HANG_GUARD * 10)  # fmt: skip
    srv = EngineServer(engine, config)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def session(server):
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as s:
        yield s


def _connect(session, headers=AUTH):
    return session.ws_connect(SPEECH_STREAM_PATH, headers=headers, protocols=(SPEECH_STREAM_SUBPROTOCOL,),
                              timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD))  # fmt: skip


async def _next(ws):
    """The next message: a JSON event as a dict, audio as bytes."""
    m = await asyncio.wait_for(ws.receive(), HANG_GUARD)
    if m.type == aiohttp.WSMsgType.TEXT:
        return json.loads(m.data)
    if m.type == aiohttp.WSMsgType.BINARY:
        return m.data
    raise AssertionError(f"the socket closed: {m}")


async def _wait(predicate) -> None:
    for _ in range(HANG_GUARD * 20):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not get there")


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def _post_pcm(server, text: str, start: dict = START) -> bytes:
    """The same utterance over POST, its whole text at once, dual-track."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                 timeout=HANG_GUARD) as c:  # fmt: skip
        r = await c.post("/v1/audio/speech", json={**start, "input": text, "text_mode": "dual",
                                                    "response_format": "pcm", "type": None})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.content


def _same_audio(pcm: bytes, reference: bytes) -> None:
    assert len(pcm) == len(reference) > 0
    a, b = (np.frombuffer(x, "<i2").astype(np.int32) for x in (pcm, reference))
    assert np.abs(a - b).max() <= 16  # the same codes; chunked decoding differs by rounding


def _chunk_frames(events) -> list[int]:
    return [len(e) // (2 * FRAME_SAMPLES) for e in events if isinstance(e, bytes)]


@pytest.mark.parametrize("pieces", [1, 3, 7, ["Hel", "lo th", "ere, how a", "re you?"]])
async def test_appended_pieces_are_spoken_as_the_whole_text(server, session, checkpoint, pieces):
    """Pieces of 1, 3 or 7 characters (or cut by hand) -> session.created, PCM whose first chunk
    is small (2 frames) and the rest 4 frames at most, response.first_audio after the first
    chunk and before response.done; the text tokens fed are the whole text's, and the audio is
    the POST route's for the same text in the dual-track layout with the same seed."""
    async with _connect(session) as ws:
        assert ws.protocol == SPEECH_STREAM_SUBPROTOCOL
        await ws.send_json(START)
        for piece in pieces if isinstance(pieces, list) else _pieces(TEXT, pieces):
            await ws.send_json({"type": "input_text.append", "text": piece})
        await ws.send_json({"type": "input_text.end"})
        events = await until_done(ws)
        await ws.close()  # the socket stayed open for another utterance: the client closes it
        assert ws.close_code == 1000
    kinds = [e["type"] if isinstance(e, dict) else "audio" for e in events]
    assert kinds[0] == "session.created" and events[0]["sample_rate"] == 24000 and events[0]["id"]
    first_audio = kinds.index("audio")
    assert kinds[first_audio + 1] == "response.first_audio" and events[first_audio + 1]["ms"] > 0
    assert kinds[-1] == "response.done" and "error" not in kinds
    assert set(kinds[1:first_audio]) <= {"input_text.ack"}
    pcm = b"".join(e for e in events if isinstance(e, bytes))
    done = events[-1]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert done["text_tokens"] == len(text_token_ids(tokenizer, TEXT))
    assert done["samples"] * 2 == len(pcm) == done["frames"] * FRAME_SAMPLES * 2
    assert done["frames"] >= done["text_tokens"]  # no EOS before the whole text was fed
    frames = _chunk_frames(events)
    assert frames[0] <= 2 and max(frames) <= 4 and sum(frames) == done["frames"]
    _same_audio(pcm, await _post_pcm(server, TEXT))


async def test_two_streams_batched_each_speak_their_whole_text(server, session):
    """Two sockets in one batch (both speaking before either text ends), fed 3- and 7-character
    pieces: each one's audio is the POST route's for its whole text, spoken alone."""
    handler = server.engine.active
    texts = {3: TEXT, 7: "Another voice, speaking at the same time."}
    async with _connect(session) as a, _connect(session) as b:
        sockets = {3: a, 7: b}
        for size, ws in sockets.items():
            await ws.send_json(START)
            for piece in _pieces(texts[size], size):
                await ws.send_json({"type": "input_text.append", "text": piece})
        heard = {}
        for size, ws in sockets.items():  # both rows are in the worker, their texts open
            heard[size] = []
            while not isinstance(m := await _next(ws), bytes):
                heard[size].append(m)
            heard[size].append(m)
        for ws in sockets.values():
            await ws.send_json({"type": "input_text.end"})
        for size, ws in sockets.items():
            heard[size] += await until_done(ws)
    finished = list(handler.history)[-2:]
    assert all(h["peak_batch"] >= 2 for h in finished), finished
    for size, text in texts.items():
        assert heard[size][-1]["type"] == "response.done"
        pcm = b"".join(e for e in heard[size] if isinstance(e, bytes))
        _same_audio(pcm, await _post_pcm(server, text))


async def test_status_says_the_engine_takes_streamed_text(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH) as c:
        status = (await c.get("/v1/engine/status")).json()
    assert status["streaming_text"] is True and status["streaming_text_route"] == SPEECH_STREAM_PATH


async def test_no_key_is_refused_before_the_upgrade(server, session):
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        async with _connect(session, headers={}):
            pass
    assert e.value.status == 401
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        ws = await c.get(SPEECH_STREAM_PATH)
        post = await c.post("/v1/audio/speech", json={"input": "x"})
    assert ws.status_code == post.status_code == 401 and ws.json() == post.json()


async def _error_of(session, *messages) -> tuple[dict, int]:
    async with _connect(session) as ws:
        for m in messages:
            if isinstance(m, bytes):
                await ws.send_bytes(m)
            elif isinstance(m, str):
                await ws.send_str(m)
            else:
                await ws.send_json(m)
        events = await until_close(ws)
        code = ws.close_code
    errors = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    assert len(errors) == 1 and events[-1] is errors[0], events
    return errors[0], code


async def _post_error(server, body: dict) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH) as c:
        r = await c.post("/v1/audio/speech", json=body)
    return r.status_code, r.json() if r.status_code != 200 else None


@pytest.mark.parametrize("fields", [{"voice": "nobody"}, {"language": "klingon"},
                                    {"temperature": 9}, {"text_mode": "prompt"}])  # fmt: skip
async def test_a_bad_start_gets_the_error_post_gives(server, session, fields):
    error, code = await _error_of(session, {**START, **fields})
    status, body = await _post_error(server, {**START, "input": TEXT, "stream": True, "type": None,
                                              **fields, "text_stream": None})  # fmt: skip
    if fields.get("text_mode") == "prompt":  # POST takes it: only streamed text refuses it
        assert status == 200 and error["status"] == 400 and error["error"]["param"] == "text_mode"
    else:
        assert error["status"] == status == 400 and {"error": error["error"]} == body
    assert code == 1008


async def test_text_errors_get_the_errors_post_gives(server, session):
    long = "x" * (LIMIT + 1)
    error, _ = await _error_of(session, START, {"type": "input_text.append", "text": long})
    status, body = await _post_error(server, {**START, "type": None, "input": long})
    assert error["status"] == status == 400 and {"error": error["error"]} == body
    error, _ = await _error_of(session, START, {"type": "input_text.append", "text": " \u200b "},
                               {"type": "input_text.end"})  # fmt: skip
    status, body = await _post_error(server, {**START, "type": None, "input": " \u200b "})
    assert error["status"] == status == 400 and {"error": error["error"]} == body


@pytest.mark.parametrize(("messages", "says"), [
    (["not json"], "JSON"),
    ([b"\x00\x01"], "binary"),
    ([{"type": "input_text.append", "text": "hi"}], "before session.start"),
    ([START, START], "started already"),
    ([START, {"type": "input_text.append", "text": "Some words to speak, and more of them. " * 4},
      {"type": "input_text.end"}, {"type": "input_text.append", "text": "x"}], "after"),
    ([START, {"type": "input_text.end"}], "non-empty"),
    ([START, {"type": "what"}], "unknown message type"),
    ([START, {"type": "input_text.append", "text": 5}], "string"),
    ([[1, 2]], "JSON object"),
])  # fmt: skip
async def test_bad_messages_end_the_session_with_a_400(server, session, messages, says):
    error, code = await _error_of(session, *messages)
    assert error["status"] == 400 and says in error["error"]["message"] and code == 1008
    assert error["error"]["type"] == "invalid_request_error"


async def test_closing_the_socket_cancels_and_frees_the_slot(server, session):
    handler = server.engine.active
    finished = len(handler.history)
    async with _connect(session) as ws:
        await ws.send_json(START)
        await ws.send_json({"type": "input_text.append", "text": "Hello there and more words "})
        while not isinstance((m := await asyncio.wait_for(ws.receive(), HANG_GUARD)).data, bytes):
            assert m.type == aiohttp.WSMsgType.TEXT
        assert handler.in_flight == 1  # speaking, its text still open
    # the row is freed: the status's running count goes back to 0, and the worker cancelled it
    await _wait_async(lambda: _queue_depth(server), 0)
    await _wait(lambda: len(handler.history) > finished)
    assert handler.history[-1]["cancelled"] and handler.history[-1]["text_mode"] == "dual"


async def _queue_depth(server) -> int:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH) as c:
        status = (await c.get("/v1/engine/status")).json()
    return sum(h["queue_depth"] for h in status["handlers"])


async def _wait_async(read, value) -> None:
    for _ in range(HANG_GUARD * 20):
        if await read() == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not get there")


async def _metrics(server) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH) as c:
        text = (await c.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


async def test_sessions_are_counted_as_post_requests_are(server, session):
    """A spoken session counts as a 200 with its first audio observed, a bad one as a 400."""
    before = await _metrics(server)
    async with _connect(session) as ws:
        await ws.send_json({**START, "input": TEXT})
        await ws.send_json({"type": "input_text.end"})
        assert (await until_done(ws))[-1]["type"] == "response.done"
    await _error_of(session, b"binary")
    after = {}

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    async def counted() -> bool:  # the server counts a session when its handler returns
        after.update(await _metrics(server))
        return (
            grew("qwen3_tts_requests_total", status="400") >= 1
            and grew("qwen3_tts_requests_total", status="200") >= 1
        )

    await _wait_async(counted, True)
    assert grew("qwen3_tts_requests_total", status="200") == 1
    assert grew("qwen3_tts_requests_total", status="400") == 1
    assert grew("qwen3_tts_first_audio_seconds_count", variant="bf16") == 1


async def test_response_cancel_ends_with_a_cancelled_done(server, session):
    handler = server.engine.active
    async with _connect(session) as ws:
        await ws.send_json(START)
        await ws.send_json({"type": "input_text.append", "text": "Some words to speak "})
        while not isinstance((await asyncio.wait_for(ws.receive(), HANG_GUARD)).data, bytes):
            pass
        await ws.send_json({"type": "response.cancel"})
        events = await until_done(ws)
    done = [e for e in events if isinstance(e, dict) and e["type"] == "response.done"]
    assert done and done[-1]["cancelled"] is True
    await _wait(lambda: handler.in_flight == 0)


async def test_a_stream_waiting_for_text_holds_no_one_back(server, session):
    """A socket whose text stops coming leaves the batch: a POST request is spoken from start
    to end meanwhile, the waiting stream counted by the worker; then its text comes and it
    finishes."""
    handler = server.engine.active
    waits = handler.batching.get("text_waits", 0)
    async with _connect(session) as ws:
        await ws.send_json(START)
        await ws.send_json({"type": "input_text.append", "text": "Wait for "})
        while not isinstance((await asyncio.wait_for(ws.receive(), HANG_GUARD)).data, bytes):
            pass  # it spoke what it had (its pending frames are flushed when it waits)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                     timeout=HANG_GUARD) as c:  # fmt: skip
            r = await c.post("/v1/audio/speech", json={**START, "type": None, "input": "Meanwhile.",
                                                        "response_format": "pcm"})  # fmt: skip
        assert r.status_code == 200 and r.content
        assert handler.in_flight == 1  # the socket's stream is still open
        await _wait(lambda: handler.batching.get("text_waits", 0) > waits)
        await ws.send_json({"type": "input_text.append", "text": "me, please."})
        await ws.send_json({"type": "input_text.end"})
        events = await until_done(ws)
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0
    # its playback restarts after the wait: the LLM's pause is not the engine's underrun
    stats = handler.last_stats
    assert stats["text_waits"] >= 1 and stats["resumed_chunks"] >= 1, stats


async def test_ten_megabytes_of_text_get_the_error_post_gives(server, session):
    huge = "word " * (2 * 1024 * 1024)  # 10 MiB: one frame, under the body limit
    error, code = await _error_of(session, START, {"type": "input_text.append", "text": huge})
    status, body = await _post_error(server, {**START, "type": None, "input": huge})
    assert error["status"] == status == 400 and {"error": error["error"]} == body and code == 1008
    assert error["error"]["param"] == "input" and str(LIMIT) in error["error"]["message"]


async def test_a_burst_of_a_thousand_appends_is_spoken(server, session):
    """1000 one-character appends at once: taken in order, acknowledged with growing token
    counts (never once per append), spoken to the frame cap; the engine speaks on after."""
    text = ("many small words " * 60)[:LIMIT]
    async with _connect(session) as ws:
        await ws.send_json({**START, "max_new_tokens": 24})
        for ch in text:
            await ws.send_json({"type": "input_text.append", "text": ch})
        await ws.send_json({"type": "input_text.end"})
        events = await until_done(ws)
    assert not [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    acks = [e for e in events if isinstance(e, dict) and e["type"] == "input_text.ack"]
    tokens = [a["tokens"] for a in acks]
    assert tokens == sorted(set(tokens)) and len(acks) < len(text)
    assert [a["chars"] for a in acks] == sorted(a["chars"] for a in acks)
    done = events[-1]
    assert done["type"] == "response.done" and done["frames"] == 24
    assert server.engine.active.history[-1]["hit_token_cap"]
    assert len(await _post_pcm(server, "Still speaking.")) > 0


def _client_frame(text: str) -> bytes:
    """One masked WebSocket text frame, as a client sends it (RFC 6455 5.2)."""
    data = text.encode()
    n = len(data)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    mask = os.urandom(4)
    return b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def _raw_socket_that_never_reads(
    port: int,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket opened by hand over a socket with the smallest receive buffer, whose
    reader is never read after the handshake."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {SPEECH_STREAM_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                  "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Protocol: {SPEECH_STREAM_SUBPROTOCOL}\r\n"
                  f"Authorization: Bearer {API_KEY}\r\n\r\n").encode())  # fmt: skip
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def test_a_client_that_never_reads_is_dropped_and_holds_no_one_back(server, session):
    """A client stops reading while its audio comes: once the bounded send buffer is full its
    connection is cut and its synthesis cancelled (its row freed); another socket speaks its
    whole utterance meanwhile."""
    handler = server.engine.active
    finished = len(handler.history)
    bound = server.config.ws_send_buffer_bytes
    server.config.ws_send_buffer_bytes = 16 * 1024  # ~0.3 s of audio
    try:
        reader, writer = await _raw_socket_that_never_reads(server.port)
    finally:
        server.config.ws_send_buffer_bytes = bound  # the other socket gets the usual bound
    writer.write(_client_frame(json.dumps(START)))
    writer.write(_client_frame(json.dumps({"type": "input_text.append", "text": LONG_TEXT})))
    await writer.drain()
    async with _connect(session) as ws:
        await ws.send_json(START)
        await ws.send_json({"type": "input_text.append", "text": TEXT})
        await ws.send_json({"type": "input_text.end"})
        events = await until_done(ws)
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0
    await _wait(lambda: handler.in_flight == 0 and len(handler.history) >= finished + 2)
    dropped = [h for h in list(handler.history)[finished:] if h["cancelled"]]
    assert len(dropped) == 1 and dropped[0]["frames"] > 0  # it spoke, then was dropped
    with contextlib.suppress(ConnectionError):  # the server cut it: what was left ends in EOF
        while await asyncio.wait_for(reader.read(1 << 16), HANG_GUARD):
            pass
    writer.close()
    assert len(await _post_pcm(server, "Still speaking.")) > 0
