"""A socket that lives as long as the call (issue 45 item 1): utterances one after another on one
WebSocket, each spoken as on a fresh socket; a cancel, then the next utterance; an idle socket
closed after ws_keepalive_timeout_s; hostile text in a later utterance refused as in the first.
Real sockets on 127.0.0.1, worker processes, the tiny checkpoint whose utterances end by EOS.
Order is shown by events and the engine's state; the only timeout that fires is the one under
test."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qwen3_tts_engine.protocol import Limits
from tests.support.speech_socket import (
    HANG_GUARD,
    PATIENT_SOCKETS,
    assert_same_audio,
    client_session,
    connect,
    engine_server,
    receive,
    speak,
    until_done,
    utterance,
)

pytestmark = pytest.mark.slow
API_KEY = "calls-key"
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
REPLIES = ["Hello there, how are you?", "I am fine, thanks.", "Goodbye for now!"]


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(checkpoint, 2, api_key=API_KEY, limits=Limits(max_input_chars=2000),
                             **PATIENT_SOCKETS) as srv:  # fmt: skip
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


def _pcm(events: list) -> bytes:
    return b"".join(e for e in events if isinstance(e, bytes))


async def _metrics(server) -> dict:
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        text = (await c.get(f"http://127.0.0.1:{server.port}/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


async def _until(read, what: str):
    for _ in range(HANG_GUARD * 20):
        if value := await read():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not get to {what}")


async def _load(server) -> dict:
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        return (await c.get(f"http://127.0.0.1:{server.port}/load")).json()


async def test_three_utterances_on_one_socket_are_each_spoken_as_on_a_fresh_one(server, session):
    """Three replies on one socket: each gets its own id and its response.done, and its PCM is
    the same reply's on a socket of its own (same seed); the metrics count one
    connection that carried three utterances."""
    fresh = [_pcm(await speak(session, API_KEY, START, [r[:5], r[5:]])) for r in REPLIES]
    label = (("protocol", "speech_stream"),)
    before = await _metrics(server)
    async with connect(session, API_KEY) as ws:
        heard = [await utterance(ws, START, [r[:5], r[5:]]) for r in REPLIES]
        assert not ws.closed  # still open for a fourth
    after = {}

    async def closed_and_counted() -> bool:  # observed as the server's handler returns
        after.update(await _metrics(server))
        key = ("qwen3_tts_socket_utterances_count", label)
        return after.get(key, 0) > before.get(key, 0)

    await _until(closed_and_counted, "the socket's close counted")
    ids = [events[0]["id"] for events in heard]
    assert ids[1:] == [f"{ids[0]}.2", f"{ids[0]}.3"], ids
    for events, reference in zip(heard, fresh, strict=True):
        assert events[0]["type"] == "session.created" and events[-1]["type"] == "response.done"
        assert not [e for e in events if isinstance(e, dict) and e["type"] == "error"]
        assert_same_audio(_pcm(events), reference)
    grew = {name: after.get((name, label), 0) - before.get((name, label), 0)
            for name in ("qwen3_tts_socket_connections_total", "qwen3_tts_socket_utterances_count",
                         "qwen3_tts_socket_utterances_sum")}  # fmt: skip
    assert grew == {"qwen3_tts_socket_connections_total": 1, "qwen3_tts_socket_utterances_count": 1,
                    "qwen3_tts_socket_utterances_sum": 3}, grew  # fmt: skip


async def test_a_cancel_then_the_next_utterance_on_the_same_socket(server, session):
    """Barge-in: response.cancel stops the reply (a cancelled response.done); the socket then
    holds no stream (`/load`: waiting for text), a late second cancel is ignored, and the next
    session.start is spoken whole, as on a fresh socket."""
    reference = _pcm(await speak(session, API_KEY, START, [REPLIES[1]]))
    async with connect(session, API_KEY) as ws:
        await ws.send_json(START)
        await ws.send_json(
            {"type": "input_text.append", "text": "A long reply that goes on and on "}
        )
        while not isinstance(await receive(ws), bytes):  # it speaks
            pass
        await ws.send_json({"type": "response.cancel"})
        done = (await until_done(ws))[-1]
        assert done["type"] == "response.done" and done["cancelled"] is True
        load = await _until(lambda: _idle_socket(server), "the cancelled stream gone")
        assert load["sessions"] == 1 and load["sessions_waiting_for_text"] == 1, load
        await ws.send_json({"type": "response.cancel"})  # too late: nothing to cancel
        events = await utterance(ws, START, [REPLIES[1]])
    assert events[0]["type"] == "session.created"  # nothing answered the late cancel
    assert events[-1]["type"] == "response.done" and "cancelled" not in events[-1]
    assert_same_audio(_pcm(events), reference)


async def _idle_socket(server) -> dict | None:
    load = await _load(server)
    return load if load["running"] == 0 and load["waiting"] == 0 else None


async def test_text_in_flight_when_a_capped_utterance_ends_is_dropped(server, session):
    """An utterance that ends at its frame cap while its text is still coming: the pieces and
    the end already on their way are dropped without an error, and the next utterance is spoken."""
    async with connect(session, API_KEY) as ws:
        await ws.send_json({**START, "max_new_tokens": 4})
        await ws.send_json({"type": "input_text.append", "text": "A reply cut short by its cap, "})
        done = (await until_done(ws))[-1]
        assert done["type"] == "response.done" and done["capped"] is True
        await ws.send_json({"type": "input_text.append", "text": "and more of it."})
        await ws.send_json({"type": "input_text.end"})
        events = await utterance(ws, START, [REPLIES[2]])
    assert [e["type"] for e in events if isinstance(e, dict)][0] == "session.created"
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0


async def test_an_idle_socket_is_closed_after_the_keepalive_timeout(server, session, monkeypatch):
    """Between utterances (or before the first) a socket holds nothing; after
    ws_keepalive_timeout_s the server closes it normally (1000, the reason says why), with no
    error event: nothing failed."""
    async with connect(session, API_KEY) as ws:
        events = await utterance(ws, START, [REPLIES[0]])
        assert events[-1]["type"] == "response.done"
        monkeypatch.setattr(server.config, "ws_keepalive_timeout_s", 0.5)
        await ws.ping()  # the server reads its deadline anew (it counts from the response.done)
        closed = await receive(ws)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000, closed
    assert "ws_keepalive_timeout_s" in closed.extra
    async with connect(session, API_KEY) as ws:  # a socket that never starts one
        closed = await receive(ws)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000, closed
    monkeypatch.setattr(server.config, "ws_keepalive_timeout_s", HANG_GUARD * 10)
    await _until(lambda: _no_sockets(server), "no sockets")


async def _no_sockets(server) -> bool:
    return (await _load(server))["sessions"] == 0


@pytest.mark.parametrize(("message", "param"), [
    ({"type": "input_text.append", "text": "Hi \ud83d"}, "text"),
    ({**START, "input": "Hi \ud83d"}, "input"),
])  # fmt: skip
async def test_hostile_text_in_a_later_utterance_is_refused_as_in_the_first(
    server, session, message, param
):
    """A lone surrogate in the second utterance: the 400 error event naming the field, close
    1008; the worker keeps its pid and the next socket is served."""
    pid = server.engine.active.pid
    async with connect(session, API_KEY) as ws:
        assert (await utterance(ws, START, [REPLIES[0]]))[-1]["type"] == "response.done"
        if message["type"] == "input_text.append":
            await ws.send_json(START)
            assert (await receive(ws))["type"] == "session.created"
        await ws.send_str(json.dumps(message))
        events = await until_done(ws)
        code = ws.close_code
    errors = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["status"] == 400 and errors[0]["error"]["param"] == param
    assert code == 1008
    assert server.engine.active.pid == pid and server.engine.active.restarts == 0
    events = await speak(session, API_KEY, START, [REPLIES[1]])
    assert events[-1]["type"] == "response.done" and events[-1]["frames"] > 0


async def test_a_flood_in_a_later_utterance_is_counted_per_utterance(server, session, monkeypatch):
    """ws_max_messages bounds each utterance: a second utterance gets its own count, and a
    flood in it ends the socket with the 429 error event."""
    monkeypatch.setattr(server.config, "ws_max_messages", 15)
    async with connect(session, API_KEY) as ws:
        pieces = ["Some", " words"] * 5  # 12 messages: under the bound, over it on one socket
        for _ in range(2):
            assert (await utterance(ws, START, pieces))[-1]["type"] == "response.done"
        await ws.send_json(START)
        for _ in range(60):
            await ws.send_json({"type": "input_text.append", "text": ""})
        events = await until_done(ws)
        code = ws.close_code
    assert events[-1]["type"] == "error" and events[-1]["status"] == 429 and code == 1008
