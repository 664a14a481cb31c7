"""The hosted Qwen3-TTS realtime protocol at its own path (issue 45 item 2), spoken to by a plain
aiohttp client written from the hosted service's documentation (its client and server events),
in both commit modes: audio comes; bad messages get that protocol's error events; hostile text
is refused as on the engine's own socket; the audio is the engine's own protocol's for the same
text and seed. Real sockets on 127.0.0.1, worker processes, the tiny checkpoint whose utterances
end by EOS. Order is shown by events, never by time."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import aiohttp
import dashscope
import httpx
import pytest
from dashscope.audio.qwen_tts_realtime import QwenTtsRealtime, QwenTtsRealtimeCallback

from qwen3_tts_engine.protocol import QWEN_REALTIME_PATH, Limits
from qwen3_tts_engine.serving.qwen_realtime import sentence_parts
from tests.support.speech_socket import (
    HANG_GUARD,
    PATIENT_SOCKETS,
    assert_same_audio,
    client_session,
    engine_server,
    speak,
)

API_KEY = "realtime-key"
URL = f"{QWEN_REALTIME_PATH}?model=qwen3-tts-flash-realtime"
# the hosted service's fields; `seed` is the engine's own (for the comparison with its protocol)
SESSION = {"voice": "ryan", "mode": "server_commit", "language_type": "English",
           "response_format": "pcm", "sample_rate": 24000, "speech_rate": 1.0, "seed": 3}  # fmt: skip
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
TEXT = "Hello there, how are you?"
RESPONSE_EVENTS = ["response.created", "response.output_item.added", "response.content_part.added",
                   "response.audio.delta", "response.audio.done", "response.content_part.done",
                   "response.output_item.done", "response.done"]  # fmt: skip


def test_server_commit_cuts_the_text_at_sentence_ends():
    assert sentence_parts("Hello there. How are") == [("Hello there.", True), (" How are", False)]
    assert sentence_parts("you?") == [("you?", True)]
    assert sentence_parts("It costs 3.5 euros") == [("It costs 3.5 euros", False)]
    assert sentence_parts('He said "hi!" then') == [('He said "hi!"', True), (" then", False)]
    assert sentence_parts("你好。我是千问") == [("你好。", True), ("我是千问", False)]
    assert sentence_parts("") == []


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(checkpoint, 2, api_key=API_KEY, limits=Limits(max_input_chars=1000),
                             **PATIENT_SOCKETS) as srv:  # fmt: skip
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


class Client:
    """What a client of the hosted service does: Bearer key, JSON events with an event_id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.n = 0

    async def send(self, kind: str, **fields) -> str:
        self.n += 1
        event_id = f"event_client_{self.n}"
        await self.ws.send_json({"event_id": event_id, "type": kind, **fields})
        return event_id

    async def event(self) -> dict | aiohttp.WSMessage:
        m = await asyncio.wait_for(self.ws.receive(), HANG_GUARD)
        if m.type != aiohttp.WSMsgType.TEXT:
            return m
        event = json.loads(m.data)
        assert isinstance(event["event_id"], str) and event["event_id"], event
        return event

    async def until(self, kind: str) -> list:
        """Every event up to the first of `kind` (an error or a close before it fails)."""
        out = []
        while True:
            event = await self.event()
            assert isinstance(event, dict), f"closed before {kind}: {event}"
            out.append(event)
            if event["type"] == kind:
                return out
            assert event["type"] != "error", event


def _connect(session, key: str | None = API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return session.ws_connect(
        URL, headers=headers, timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD)
    )


def _audio(events: list) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"
    )


def _kinds(events: list) -> list[str]:
    """The event types in order, runs of audio deltas as one."""
    out = []
    for e in events:
        if not (out and e["type"] == out[-1] == "response.audio.delta"):
            out.append(e["type"])
    return out


async def _opened(session, settings: dict) -> Client:
    ws = await _connect(session)
    client = Client(ws)
    created = await client.event()
    assert (
        created["type"] == "session.created" and created["session"]["object"] == "realtime.session"
    )
    assert created["session"]["model"] == "qwen3-tts-flash-realtime" and created["session"]["id"]
    await client.send("session.update", session=settings)
    updated = await client.event()
    assert updated["type"] == "session.updated", updated
    assert {k: updated["session"][k] for k in ("mode", "voice", "sample_rate")} == {
        "mode": settings["mode"],
        "voice": settings["voice"],
        "sample_rate": settings["sample_rate"],
    }
    return client


@pytest.mark.slow
async def test_server_commit_mode_speaks_as_the_text_comes(server, session):
    """server_commit: the text streams in pieces, no commit; the response runs to the sentence's
    end (the hosted service's event sequence, base64 PCM deltas), the engine's
    own protocol's audio for the same text and seed; session.finish ends with
    session.finished and a normal close."""
    reference = b"".join(
        e for e in await speak(session, API_KEY, START, [TEXT]) if isinstance(e, bytes)
    )
    client = await _opened(session, SESSION)
    for i in range(0, len(TEXT), 4):
        await client.send("input_text_buffer.append", text=TEXT[i : i + 4])
    events = await client.until("response.done")
    assert _kinds(events) == RESPONSE_EVENTS, _kinds(events)
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["characters"] == len(TEXT)
    assert events[0]["response"]["id"] == done["id"] == events[3]["response_id"]
    assert_same_audio(_audio(events), reference)
    await client.send("session.finish")
    assert (await client.event())["type"] == "session.finished"
    closed = await client.event()
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000
    await client.ws.close()


@pytest.mark.slow
async def test_server_commit_mode_speaks_sentences_in_turn_and_finish_flushes(server, session):
    """Two sentences in one append and a third without its end: one response per sentence, in
    order; session.finish speaks the unfinished one, then session.finished."""
    client = await _opened(session, {**SESSION, "sample_rate": 16000})
    await client.send("input_text_buffer.append", text="Hello there. How are you? And ")
    await client.send("input_text_buffer.append", text="then")
    await client.send("session.finish")
    responses = [await client.until("response.done") for _ in range(3)]
    assert (await client.event())["type"] == "session.finished"
    await client.ws.close()
    assert [r[-1]["response"]["usage"]["characters"] for r in responses] == [12, 13, 9]
    assert len({r[-1]["response"]["id"] for r in responses}) == 3
    for events in responses:
        assert _kinds(events) == RESPONSE_EVENTS
        pcm = _audio(events)
        frames = events[-1]["response"]["qwen3_tts"]["frames"]
        assert len(pcm) == frames * 1280 * 2 > 0  # 1920 samples at 24 kHz = 1280 at 16 kHz


@pytest.mark.slow
async def test_commit_mode_speaks_on_commit_only(server, session):
    """commit: appended text waits for the client's commit (input_text_buffer.committed comes
    before any response event); an empty commit is an error event the session survives; clear
    drops what was appended."""
    client = await _opened(session, {**SESSION, "mode": "commit"})
    await client.send("input_text_buffer.append", text="Dropped text.")
    await client.send("input_text_buffer.clear")
    assert (await client.event())["type"] == "input_text_buffer.cleared"
    commit = await client.send("input_text_buffer.commit")
    error = await client.event()
    assert error["type"] == "error" and error["error"]["event_id"] == commit, error
    assert error["error"]["code"] == "invalid_value" and "empty" in error["error"]["message"]
    for piece in ("Hello there, ", "how are you?"):
        await client.send("input_text_buffer.append", text=piece)
    await client.send("input_text_buffer.commit")
    events = await client.until("response.done")
    assert events[0]["type"] == "input_text_buffer.committed" and "item_id" in events[0]
    assert _kinds(events[1:]) == RESPONSE_EVENTS
    assert events[-1]["response"]["usage"]["characters"] == len(TEXT)
    await client.send("session.finish")
    assert (await client.event())["type"] == "session.finished"
    await client.ws.close()


@pytest.mark.slow
async def test_cancel_stops_the_response_and_the_session_goes_on(server, session):
    client = await _opened(session, SESSION)
    await client.send("input_text_buffer.append", text="A long reply that goes on and on, ")
    await client.until("response.audio.delta")
    await client.send("response.cancel")
    done = (await client.until("response.done"))[-1]
    assert done["response"]["status"] == "cancelled"
    await client.send("input_text_buffer.append", text=TEXT)
    assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
    await client.ws.close()


async def _refused(session, *events, settings: dict | None = SESSION) -> tuple[dict, int]:
    """Send the events (after a session.update, unless None); the error event and close code."""
    async with _connect(session) as ws:
        client = Client(ws)
        assert (await client.event())["type"] == "session.created"
        if settings is not None:
            await client.send("session.update", session=settings)
            assert (await client.event())["type"] == "session.updated"
        for e in events:
            await ws.send_str(e if isinstance(e, str) else json.dumps(e))
        while True:
            event = await client.event()
            assert isinstance(event, dict), f"closed without an error event: {event}"
            if event["type"] == "error":
                break
        closed = await client.event()
    assert closed.type == aiohttp.WSMsgType.CLOSE, closed
    return event["error"], closed.data


@pytest.mark.slow
@pytest.mark.parametrize(("events", "param", "says"), [
    (["not json"], None, "JSON"),
    ([{"type": "response.create"}], "type", "unknown event type"),
    ([{"type": "session.update", "session": {"voice": "Cherry"}}], "session.voice", "voice"),
    ([{"type": "session.update", "session": {"mode": "auto"}}], "session.mode", "mode"),
    ([{"type": "session.update", "session": {"response_format": "mp3"}}], "session.response_format", "pcm"),
    ([{"type": "session.update", "session": {"sample_rate": 22050}}], "session.sample_rate", "sample_rate"),
    ([{"type": "input_text_buffer.append", "text": 5}], "text", "string"),
    ([{"type": "input_text_buffer.append", "text": "x" * 1001}], "input", "1000"),
    ([{"type": "session.update", "session": ["voice"]}], "session", "JSON object"),
])  # fmt: skip
async def test_bad_events_get_the_protocols_error_event(server, session, events, param, says):
    error, code = await _refused(session, *events)
    assert error["type"] == "invalid_request_error" and error["code"] and says in error["message"]
    assert error["param"] == param and code == 1008, error


@pytest.mark.slow
@pytest.mark.parametrize("event", [
    {"type": "input_text_buffer.append", "text": "Hi \ud83d"},
    {"type": "input_text_buffer.append", "text": "ok \U0010fffe"},
    {"type": "session.update", "session": {"instructions": "\udead"}},
])  # fmt: skip
async def test_hostile_text_is_an_error_event_and_the_server_goes_on(server, session, event):
    pid = server.engine.active.pid
    error, code = await _refused(session, json.dumps(event))
    assert error["status"] == 400 and code == 1008 and "U+" in error["message"], error
    assert server.engine.active.pid == pid and server.engine.active.restarts == 0
    client = await _opened(session, SESSION)
    await client.send("input_text_buffer.append", text=TEXT)
    assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
    await client.ws.close()


async def test_no_key_is_refused_before_the_upgrade(server, session):
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        async with _connect(session, key=None):
            pass
    assert e.value.status == 401
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        assert (await c.get(QWEN_REALTIME_PATH)).status_code == 401


# -- the hosted service's own Python SDK (dashscope), pointed at the engine ------------------


class _SdkEvents(QwenTtsRealtimeCallback):
    """Collects what the SDK hands its callback (on the SDK's own thread)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.responses = threading.Semaphore(0)
        self.finished = threading.Event()
        self.closed = threading.Event()
        self.close_code = None

    def on_event(self, message) -> None:
        self.events.append(message)
        if message["type"] == "response.done":
            self.responses.release()
        elif message["type"] == "session.finished":
            self.finished.set()

    def on_close(self, close_status_code, close_msg) -> None:
        self.close_code = close_status_code
        self.closed.set()


def _sdk_session(port: int, mode: str) -> _SdkEvents:
    """A whole session the way the SDK's own samples run one (blocking: run in a thread)."""
    dashscope.api_key = API_KEY
    events = _SdkEvents()
    tts = QwenTtsRealtime(model="qwen3-tts-flash-realtime", callback=events,
                          url=f"ws://127.0.0.1:{port}{QWEN_REALTIME_PATH}")  # fmt: skip
    tts.connect()
    # `seed` is the engine's own field: the SDK passes extra keywords through to session.update
    tts.update_session(voice="ryan", mode=mode, language_type="English", seed=3)
    for i in range(0, len(TEXT), 5):
        tts.append_text(TEXT[i : i + 5])
    if mode == "commit":
        tts.commit()
        assert events.responses.acquire(timeout=HANG_GUARD)
    tts.finish()
    assert events.finished.wait(HANG_GUARD) and events.closed.wait(HANG_GUARD)
    assert tts.get_session_id() and tts.get_last_response_id()
    return events


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["server_commit", "commit"])
async def test_the_hosted_services_python_sdk_works_against_the_engine(server, session, mode):
    """dashscope's `QwenTtsRealtime`, unchanged but for its `url`: both modes get the audio the
    engine's own protocol gives for the same text and seed, and a normal close."""
    reference = b"".join(
        e for e in await speak(session, API_KEY, START, [TEXT]) if isinstance(e, bytes)
    )
    events = await asyncio.to_thread(_sdk_session, server.port, mode)
    assert not [e for e in events.events if e["type"] == "error"], events.events
    assert events.close_code == 1000
    assert_same_audio(_audio(events.events), reference)
