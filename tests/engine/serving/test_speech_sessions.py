"""WebSocket sessions that wait, end early or misbehave hold nothing back (issue 43): a session
holds a stream and a real-time slot only once its text has begun; a socket closed or reset at
any moment frees its row and slot; a cancel stops the audio; idle sessions time out; pings find
dead peers; the number of open sessions is capped. Real sockets on 127.0.0.1, worker processes,
the tiny checkpoint whose utterances end by EOS. Order is shown by events and the engine's state;
the only timeouts that fire are the ones under test."""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import httpx
import pytest

from qwen3_tts_engine.protocol import Limits
from tests.support.speech_socket import (
    HANG_GUARD,
    client_session,
    connect,
    engine_server,
    receive,
    speak,
)

pytestmark = pytest.mark.slow
API_KEY = "sessions-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
LONG_TEXT = "A long reply that goes on and on and on, " * 20


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    # two rows: two idle sessions holding a slot each (the old behaviour) would leave none
    async with engine_server(checkpoint, 2, api_key=API_KEY, limits=Limits(max_input_chars=2000),
                             ws_first_text_timeout_s=HANG_GUARD * 10, ws_idle_timeout_s=HANG_GUARD * 10,
                             ws_heartbeat_s=0, ws_send_timeout_s=HANG_GUARD * 10) as srv:  # fmt: skip
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


async def _load(server) -> dict:
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        return (await c.get(f"http://127.0.0.1:{server.port}/load")).json()


async def _until_load(server, predicate, what: str) -> dict:
    for _ in range(HANG_GUARD * 20):
        load = await _load(server)
        if predicate(load):
            return load
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not get to {what}: {load}")


async def _started(session) -> aiohttp.ClientWebSocketResponse:
    ws = await connect(session, API_KEY)
    await ws.send_json(START)
    assert (await receive(ws))["type"] == "session.created"
    return ws


async def _post(server, **body) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.port}", headers=AUTH, timeout=HANG_GUARD
    ) as c:
        return await c.post("/v1/audio/speech", json={"voice": "ryan", "language": "en", "seed": 3,
                                                      "input": "Hello there.", "response_format": "pcm",
                                                      **body})  # fmt: skip


def _reset(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), as a crashed client's kernel does."""
    transport = ws._response.connection.transport  # the client's socket under the WebSocket
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def test_sessions_waiting_for_text_hold_no_stream_and_no_slot(server, session):
    idle = [await _started(session) for _ in range(24)]
    try:
        load = await _load(server)
        assert load["sessions"] == 24 and load["sessions_waiting_for_text"] == 24, load
        assert (
            load["running"] == 0 and load["waiting"] == 0 and load["free_slots"] == load["slots"]
        ), load
        # a POST and a streamed utterance are served as on an idle engine (before: both waited
        # behind the idle sessions' slots until the hang guard)
        r = await _post(server, max_new_tokens=4)
        assert r.status_code == 200 and len(r.content) > 0
        events = await speak(session, API_KEY, START, ["Hello there."])
        assert events[-1]["type"] == "response.done" and any(isinstance(e, bytes) for e in events)
    finally:
        for ws in idle:
            await ws.close()
    load = await _until_load(server, lambda x: x["sessions"] == 0, "no sessions")
    assert (
        load["running"] == 0 and load["waiting"] == 0 and load["sessions_waiting_for_text"] == 0
    ), load


async def test_sessions_closed_or_reset_right_after_their_start_free_everything(server, session):
    sockets = []
    for _ in range(30):
        ws = await _started(session)
        await ws.send_json({"type": "input_text.append", "text": LONG_TEXT})  # its stream begins
        sockets.append(ws)
    await _until_load(server, lambda x: x["running"] + x["waiting"] == 30, "thirty streams")
    closing = [ws.close() for ws in sockets[::2]]  # half close, half reset, all at once
    for ws in sockets[1::2]:
        _reset(ws)
    await asyncio.gather(*closing)
    load = await _until_load(server, lambda x: x["running"] == 0 and x["waiting"] == 0 and x["sessions"] == 0,
                             "idle after the sockets closed")  # fmt: skip
    assert load["sessions_waiting_for_text"] == 0
    events = await speak(session, API_KEY, START, ["Hello there."])  # the next utterance is served
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0


async def test_sessions_closed_while_their_streams_wait_to_start_free_everything(server, session):
    """Streams that have begun but wait for more text before their first frame (text_start_tokens),
    all closed at once: four held (waiting for text, they lend their slots: at most two per row),
    two admitted that keep theirs, and two queued. A queued one is given its slot as the others'
    cancels free them, in the same moment its own cancel comes (Python 3.11's wait_for
    swallowed that cancel: the stream started for nobody, waited for text forever, and /load
    said running 1 for good)."""
    sockets = []
    for _ in range(8):
        ws = await connect(session, API_KEY)
        await ws.send_json({**START, "text_start_tokens": 16})
        assert (await receive(ws))["type"] == "session.created"
        await ws.send_json({"type": "input_text.append", "text": "Hi"})  # one token of 16
        sockets.append(ws)
    await _until_load(server, lambda x: (x["held"], x["running"], x["waiting"]) == (4, 2, 2),
                      "four held, two running, two queued")  # fmt: skip
    for ws in sockets:
        await ws.close()
    await _until_load(server, lambda x: x["running"] == x["held"] == x["waiting"] == x["sessions"] == 0,
                      "idle after the sockets closed")  # fmt: skip
    events = await speak(session, API_KEY, START, ["Hello there."])
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0


async def test_a_cancel_while_the_server_is_busy_stops_the_audio_within_a_chunk(server, session):
    # every step sleeps 0.25 s per stream (the step-delay fault; the codes unchanged): a chunk
    # takes seconds to make on any machine, so a cancel (a loopback message) is read before a
    # second chunk is made, however fast the machine makes them
    handler = server.engine.active
    handler.set_step_delay(0.25)
    busy = asyncio.ensure_future(_post(server, input=LONG_TEXT, text_mode="dual"))  # the other row
    try:
        await _until_load(server, lambda x: x["running"] == 1, "the busy POST")
        async with connect(session, API_KEY) as ws:
            await ws.send_json(START)
            await ws.send_json({"type": "input_text.append", "text": LONG_TEXT})
            events = []
            while not isinstance(event := await receive(ws), bytes):  # the first chunk
                events.append(event)
            await ws.send_json({"type": "response.cancel"})
            after = []
            while not (
                isinstance(event := await receive(ws), dict) and event["type"] == "response.done"
            ):
                assert not isinstance(event, aiohttp.WSMessage), (
                    f"closed before response.done: {event}"
                )
                after.append(event)
            assert event["cancelled"] is True
            chunks_after = [e for e in after if isinstance(e, bytes)]
            assert len(chunks_after) <= 1, f"{len(chunks_after)} chunks came after the cancel"
        # only the POST is left
        await _until_load(
            server, lambda x: x["running"] == 1 and x["sessions"] == 0, "the cancelled stream gone"
        )
    finally:
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        handler.set_step_delay(0.0)
    await _until_load(server, lambda x: x["running"] == 0 and x["waiting"] == 0, "idle")


async def test_idle_sessions_time_out_with_an_error_event(server, session, monkeypatch):
    monkeypatch.setattr(server.config, "ws_first_text_timeout_s", 0.5)
    ws = await _started(session)  # no text: the first text's timeout
    error = await receive(ws)
    assert (
        error["type"] == "error"
        and error["status"] == 408
        and "ws_first_text_timeout_s" in error["error"]["message"]
    )
    closed = await receive(ws)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1008
    monkeypatch.setattr(server.config, "ws_first_text_timeout_s", HANG_GUARD * 10)
    monkeypatch.setattr(server.config, "ws_idle_timeout_s", 0.5)
    ws = await _started(session)
    await ws.send_json({"type": "input_text.append", "text": "Hello"})  # then nothing, no end
    while not (isinstance(event := await receive(ws), dict) and event["type"] == "error"):
        assert not isinstance(event, aiohttp.WSMessage), event
    assert event["status"] == 408 and "ws_idle_timeout_s" in event["error"]["message"], event
    await _until_load(
        server, lambda x: x["running"] == 0 and x["sessions"] == 0, "idle after the timeouts"
    )


async def test_a_peer_that_answers_no_ping_is_closed(server, session, monkeypatch):
    monkeypatch.setattr(server.config, "ws_heartbeat_s", 0.5)
    ws = await connect(session, API_KEY, autoping=False)  # this client never answers a ping
    await ws.send_json(START)
    assert (await receive(ws))["type"] == "session.created"
    kinds = []
    while (m := await asyncio.wait_for(ws.receive(), HANG_GUARD)).type not in (
            aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):  # fmt: skip
        kinds.append(m.type)
    assert aiohttp.WSMsgType.PING in kinds, kinds
    await _until_load(server, lambda x: x["sessions"] == 0, "the session gone")


async def test_open_sessions_are_capped_at_the_upgrade(server, session, monkeypatch):
    monkeypatch.setattr(server.config, "max_sessions", 2)
    first, second = await _started(session), await _started(session)
    try:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await connect(session, API_KEY)
        assert refused.value.status == 429
        assert refused.value.headers["Retry-After"] == str(server.config.retry_after_s)
    finally:
        await first.close()
        await second.close()
    await _until_load(server, lambda x: x["sessions"] == 0, "no sessions")
    events = await speak(session, API_KEY, START, ["Hello there."])  # room again
    assert events[-1]["type"] == "response.done"
