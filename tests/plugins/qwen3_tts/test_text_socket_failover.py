"""Failover and errors of the streaming-text socket (`text_socket.py`), against faults injected on
real WebSockets (127.0.0.1).

`FaultSocketEngine` speaks the engine's streaming-text protocol (`/v1/audio/speech/stream`,
subprotocol qwen3-tts.speech.v1, status `streaming_text: true`) with audio that is a pure function
of (the words so far, seed), so a replay on another endpoint says the same as the first did, as
the real engine does (its equivalence tests); it fails on demand: a socket closed before the
first audio, an error event (503 or 400), a connection cut mid-audio, a peer that stops
reading (no pong) while the text is still open, a full engine (429 at the upgrade, or an
`engine_full` error event), an utterance ended while its text is open (as a frame cap ends
one), or one that is taken and then never answered (a stuck synthesis; pings still answered). As the engine does, it keeps a socket open after `response.done` for the next
`session.start`, and answers `response.cancel` with `response.done` (`"cancelled": true`);
`close_after_done` makes it an older engine that closes the socket after each utterance. The real
engine's socket: test_text_stream.py and test_warm_socket.py.
"""

from __future__ import annotations

import asyncio
import json
import zlib

import httpx
import numpy as np
import pytest
from aiohttp import web
from livekit.agents import APIConnectOptions, APIError, APIStatusError
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES, SPEECH_STREAM_SUBPROTOCOL
from tests.support.engine_process import free_port
from tests.support.tts_audio import pcm

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
WORDS = "The quick brown fox jumps over the lazy dog again".split()
HANG_GUARD = 60.0
PATIENT_CLIENT = httpx.Timeout(300.0)  # a probe never decides anything here


def word_pcm(index: int, word: str, seed: int) -> bytes:
    """What FaultSocketEngine says for the `index`-th word: 1.5 frames of noise."""
    rng = np.random.default_rng([seed, index, zlib.crc32(word.encode())])
    return rng.integers(-8000, 8000, FRAME_SAMPLES * 3 // 2, dtype=np.int16).tobytes()


def reference(words: list[str], seed: int) -> np.ndarray:
    return np.frombuffer(b"".join(word_pcm(i, w, seed) for i, w in enumerate(words)), np.int16)


class FaultSocketEngine:
    """A loopback streaming-text server; `fault` applies to every socket until set back to None."""

    def __init__(self) -> None:
        # close | error503 | error400 | cut | stall | full | full_upgrade | done_early | mute
        self.fault: str | None = None
        self.cut_after = 2 * len(word_pcm(0, "x", 0)) + 1001  # audio bytes before a cut: odd
        # per utterance: start message, text, ended, cancelled, open (its socket)
        self.sessions: list[dict] = []
        self.sockets = 0  # upgrades accepted
        self.close_after_done = False  # an older engine: one utterance per socket
        self.refused = 0  # upgrades answered 429
        self.open: set[web.WebSocketResponse] = set()
        self.ended_early = asyncio.Event()  # set when a `done_early` utterance has ended
        self.port = free_port()
        self._release = asyncio.Event()  # frees stalled handlers at stop
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/engine/status", self._status)
        app.router.add_get("/v1/audio/speech/stream", self._stream)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultSocketEngine:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self._release.set()
        await self._runner.cleanup()

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"handlers": [], "streaming_text": True})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if self.fault == "full_upgrade":  # too many sessions: refused before the upgrade
            self.refused += 1
            return web.json_response({"error": {"message": "too many sessions", "code": "engine_full"}},
                                     status=429, headers={"Retry-After": "9"})  # fmt: skip
        ws = web.WebSocketResponse(protocols=(SPEECH_STREAM_SUBPROTOCOL,))
        await ws.prepare(request)
        self.sockets += 1
        self.open.add(ws)
        mine: list[dict] = []  # this socket's utterances
        try:
            return await self._speak(request, ws, mine)
        finally:  # also when the client's close cancels this handler
            self.open.discard(ws)
            for session in mine:
                session["open"] = False

    async def close_sockets(self) -> None:
        """Close every open socket, as the engine's keepalive closes an idle one (1000)."""
        for ws in list(self.open):
            await ws.close()

    async def _speak(self, request: web.Request, ws: web.WebSocketResponse, mine: list[dict]):
        session: dict = {}
        spoken, sent = 0, 0
        async for msg in ws:
            event = json.loads(msg.data)
            kind = event["type"]
            if kind == "session.start":
                session = {"start": event, "text": "", "ended": False, "cancelled": False,
                           "open": True}  # fmt: skip
                self.sessions.append(session)
                mine.append(session)
                spoken, sent = 0, 0
                if self.fault in ("error503", "error400"):
                    status = int(self.fault[-3:])
                    await ws.send_json({"type": "error", "status": status, "error": {
                        "message": f"injected {status}", "type": "invalid_request_error",
                        "code": None}})  # fmt: skip
                    await ws.close(code=1008 if status < 500 else 1011)
                    return ws
                if self.fault == "close":
                    await ws.close(code=1011)
                    return ws
                await ws.send_json({"type": "session.created", "id": f"s{len(self.sessions)}",
                                    "sample_rate": 24000, "variant": "fake"})  # fmt: skip
                if self.fault == "full":  # as the engine's queue refuses it: after the start
                    await ws.send_json({"type": "error", "status": 429, "retry_after_s": 5, "error": {
                        "message": "injected full", "type": "invalid_request_error",
                        "code": "engine_full"}})  # fmt: skip
                    await ws.close(code=1008)
                    return ws
                continue
            if kind == "response.cancel":
                if session.get("done"):  # it ended before the cancel came: dropped
                    continue
                session["cancelled"] = session["done"] = True
                await ws.send_json({"type": "response.done", "cancelled": True, "frames": 0,
                                    "samples": sent // 2, "text_tokens": spoken})  # fmt: skip
                continue
            if kind == "input_text.append":
                session["text"] += event["text"]
            elif kind == "input_text.end":
                session["ended"] = True
            if self.fault == "mute":  # takes the text and its end, says nothing: a stuck synthesis
                continue
            words = session["text"].split()
            if not session["ended"] and not session["text"][-1:].isspace():
                words = words[:-1]  # the last word may go on: held back, as the engine does
            for i in range(spoken, len(words)):
                data = word_pcm(i, words[i], session["start"]["seed"])
                if self.fault == "cut" and sent + len(data) > self.cut_after:
                    await ws.send_bytes(data[: self.cut_after - sent])
                    request.transport.close()  # the engine died mid-audio
                    return ws
                await ws.send_bytes(data)
                sent += len(data)
                if self.fault == "stall":  # stops reading: pings go unanswered
                    await self._release.wait()
                    return ws
                if self.fault == "done_early" and not session["ended"]:  # a cap, text open
                    await ws.send_json({"type": "response.done", "frames": 0,
                                        "samples": sent // 2, "text_tokens": i + 1})  # fmt: skip
                    await ws.close()
                    self.ended_early.set()
                    return ws
            spoken = len(words)
            if session["ended"]:
                await ws.send_json({"type": "response.done", "frames": 0, "samples": sent // 2,
                                    "text_tokens": spoken})  # fmt: skip
                session["done"] = True
                if self.close_after_done:
                    await ws.close()
                    return ws
        return ws


@pytest.fixture
async def sockets():
    a, b = FaultSocketEngine(), FaultSocketEngine()
    await a.start(), await b.start()
    yield a, b
    await a.stop(), await b.stop()


def _tts(*urls: str, **kw) -> qwen3_tts.TTS:
    # priority order: the tests say which engine fails first
    kw = {"voice": "ryan", "language": "en", "probe_interval": 0.2, "timeout": PATIENT_CLIENT,
          "strategy": "priority", **kw}  # fmt: skip
    return qwen3_tts.TTS(base_url=list(urls), **kw)


async def _speak(tts: qwen3_tts.TTS, words=WORDS, conn=None):
    """Words pushed one by one, each after the audio of the one before it has arrived (so that
    a fault that waits for audio happens while the text is still open); end_input at the end."""
    stream = tts.stream(**({"conn_options": conn} if conn else {}))
    audio: list[np.ndarray] = []
    try:
        async with asyncio.timeout(HANG_GUARD):
            stream.push_text(words[0] + " ")
            pushed = 1
            async for ev in stream:
                data = pcm(ev)
                if data is not None:
                    audio.append(data)
                if pushed < len(words):
                    stream.push_text(words[pushed] + " ")
                    pushed += 1
                    if pushed == len(words):
                        stream.end_input()
    finally:
        await stream.aclose()
    return stream, np.concatenate(audio) if audio else np.zeros(0, np.int16)


async def test_a_socket_that_closes_before_audio_fails_over_with_the_text_so_far(sockets):
    a, b = sockets
    a.fault = "close"
    tts = _tts(a.url, b.url)  # no seed: the client picks one, the same for both sockets
    try:
        stream, audio = await _speak(tts)
    finally:
        await tts.aclose()
    report = stream.text_streams[0]
    assert report.endpoints == [a.url, b.url]
    assert a.sessions[0]["start"]["seed"] == b.sessions[0]["start"]["seed"] == report.seed
    assert b.sessions[0]["text"].split() == WORDS and b.sessions[0]["ended"]
    np.testing.assert_array_equal(audio, reference(WORDS, report.seed))
    assert tts.endpoints.endpoints[0].failures == 1  # A was marked down (its probe may be back)


async def test_a_cut_mid_audio_continues_on_the_next_engine_sample_exact(sockets):
    a, b = sockets
    a.fault = "cut"
    tts = _tts(a.url, b.url, seed=7)
    try:
        stream, audio = await _speak(tts)
    finally:
        await tts.aclose()
    report = stream.text_streams[0]
    assert report.endpoints == [a.url, b.url]
    # B was given the text A had (one replayed append), then the rest as it came
    assert b.sessions[0]["text"].split() == WORDS
    assert report.skipped_bytes == a.cut_after  # what A had played is not played again
    assert report.first_audio_before_end is True
    np.testing.assert_array_equal(audio, reference(WORDS, 7))  # nothing lost, nothing twice


async def test_a_peer_that_stops_answering_while_text_is_open_is_failed_over(sockets):
    a, b = sockets
    a.fault = "stall"
    tts = _tts(a.url, b.url, seed=3)
    # The heartbeat (timeout * 2/3) pings a peer silent that long and waits timeout / 3 for its
    # pong: A never answers (it stopped reading until the engine stops), so it is failed over at
    # any speed; B, on this same loop, has 2 s for each pong and each answer it owes.
    conn = APIConnectOptions(max_retry=0, timeout=6.0)
    try:
        stream, audio = await _speak(tts, conn=conn)
    finally:
        await tts.aclose()
    report = stream.text_streams[0]
    assert report.endpoints == [a.url, b.url]
    assert "Stalled" in (tts.endpoints.endpoints[0].last_error or "")
    np.testing.assert_array_equal(audio, reference(WORDS, 3))


async def _until(predicate) -> None:
    for _ in range(int(HANG_GUARD * 20)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the plugin did not get there")


async def test_an_engine_that_never_answers_after_the_text_ended_is_failed_over(sockets):
    """A takes the utterance (session.created) and its text, then says nothing, though it answers
    pings (a stuck synthesis). While the text is open that silence is allowed (the LLM may be
    slow); once the text has ended A owes an answer within `conn_options.timeout`, also when the
    plugin began that wait while the text was still open: it is failed over to B."""
    a, b = sockets
    a.fault = "mute"
    tts = _tts(a.url, b.url, seed=4)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=0, timeout=6.0))
    audio: list[np.ndarray] = []
    try:
        async with asyncio.timeout(HANG_GUARD):
            for word in WORDS:
                stream.push_text(word + " ")
            # A's session.created was read: the plugin now waits for A with the text open
            await _until(lambda: stream.text_streams and stream.text_streams[0].request_ids)
            stream.end_input()
            async for ev in stream:
                if (data := pcm(ev)) is not None:
                    audio.append(data)
    finally:
        await stream.aclose()
        await tts.aclose()
    report = stream.text_streams[0]
    assert report.endpoints == [a.url, b.url]
    assert "Stalled" in (tts.endpoints.endpoints[0].last_error or "")
    assert b.sessions[0]["text"].split() == WORDS and b.sessions[0]["ended"]
    np.testing.assert_array_equal(np.concatenate(audio), reference(WORDS, 4))


async def test_a_5xx_error_event_fails_over_and_a_4xx_one_is_the_callers(sockets):
    a, b = sockets
    a.fault = "error503"
    tts = _tts(a.url, b.url, seed=1)
    try:
        stream, audio = await _speak(tts)
        assert stream.text_streams[0].endpoints == [a.url, b.url]
        np.testing.assert_array_equal(audio, reference(WORDS, 1))
    finally:
        await tts.aclose()
    a.fault = b.fault = "error400"
    tts = _tts(a.url, b.url, seed=1)
    try:
        with pytest.raises(APIStatusError) as e:
            await _speak(tts, conn=APIConnectOptions(max_retry=0, timeout=30))
    finally:
        await tts.aclose()
    assert e.value.status_code == 400 and not e.value.retryable
    assert "injected 400" in e.value.message
    assert len(b.sessions) == 1  # B's one socket was the 503 round's: a 400 is not failed over


async def test_a_barge_in_cancels_on_the_socket_and_the_next_reply_reuses_it(sockets):
    """The stream is closed while its text is open (LiveKit's barge-in): the plugin sends
    `response.cancel`, the engine answers `response.done` (cancelled), and the socket goes back
    to the pool; the next reply is spoken whole on that same socket; `aclose()` closes it."""
    a, _ = sockets
    tts = _tts(a.url, seed=2)
    stream = tts.stream()
    try:
        stream.push_text("Hello there ")
        async with asyncio.timeout(HANG_GUARD):
            async for ev in stream:
                if pcm(ev) is not None:
                    break  # first audio; the text is still open
        await stream.aclose()
        stream, audio = await _speak(tts)  # waits for the cancel's answer, then takes the socket
        assert a.sessions[0]["cancelled"] and not a.sessions[0]["ended"]
        assert a.sessions[1]["ended"] and a.sessions[1]["open"]
        assert a.sockets == 1 and tts.sockets.opened == 1 and stream.text_streams[0].warm
        np.testing.assert_array_equal(audio, reference(WORDS, 2))
    finally:
        await tts.aclose()
    async with asyncio.timeout(HANG_GUARD):
        while a.sessions[0]["open"]:
            await asyncio.sleep(0.02)


async def test_replies_share_one_socket_and_an_older_engine_gets_one_each(sockets):
    """Three replies: one socket (the engine keeps it after response.done); an engine that
    closes its socket after each utterance (before the warm socket) is answered as before, on a
    new socket per reply, nothing lost."""
    a, b = sockets
    b.close_after_done = True
    for engine, sockets_used in ((a, 1), (b, 3)):
        tts = _tts(engine.url, seed=9)
        try:
            for _ in range(3):
                _, audio = await _speak(tts)
                np.testing.assert_array_equal(audio, reference(WORDS, 9))
        finally:
            await tts.aclose()
        assert engine.sockets == sockets_used == tts.sockets.opened
        assert len(engine.sessions) == 3 and all(s["ended"] for s in engine.sessions)


async def test_a_socket_closed_while_parked_is_never_spoken_on(sockets):
    """The race the parked reader cannot win: the engine closed the socket (its keepalive) but
    the client has not read the close yet when the next reply takes it. The start meets a closed
    socket; the reply goes on a new one to the same engine, whole, and the engine is not marked
    down (nothing failed)."""
    a, _ = sockets
    tts = _tts(a.url, seed=4)
    try:
        await _speak(tts)
        [sock] = tts.sockets.parked(a.url)
        await sock.take()  # the reader stops: the close below stays unread, as in the race
        await a.close_sockets()
        async with asyncio.timeout(HANG_GUARD):
            while a.open:
                await asyncio.sleep(0.02)
        assert not sock.ws.closed  # the client does not know yet
        stream, audio = await _speak(tts)
    finally:
        await tts.aclose()
    np.testing.assert_array_equal(audio, reference(WORDS, 4))
    assert a.sockets == 2 and tts.sockets.opened == 2 and len(a.sessions) == 2
    report = stream.text_streams[0]
    assert report.endpoints == [a.url] and report.warm is False
    assert tts.endpoints.endpoints[0].failures == 0


async def test_a_blank_segment_opens_no_socket(sockets):
    a, _ = sockets
    tts = _tts(a.url, seed=2)
    stream = tts.stream()
    try:
        stream.push_text("  \n ")
        stream.end_input()
        async with asyncio.timeout(HANG_GUARD):
            events = [ev async for ev in stream]
    finally:
        await stream.aclose()
        await tts.aclose()
    assert a.sessions == [] and all(pcm(ev) is None for ev in events)


@pytest.mark.parametrize(("fault", "retry_after"), [("full", 5.0), ("full_upgrade", 9.0)])
async def test_a_full_engine_passes_the_segment_to_the_next_at_once(sockets, fault, retry_after):
    """A 429 on the socket, as an `engine_full` error event or at the upgrade, is what it is on
    HTTP: the engine is passed over for its Retry-After (not marked down) and the segment goes
    to the next engine within LiveKit's one attempt (max_retry=0: no LiveKit retry)."""
    a, b = sockets
    a.fault = fault
    tts = _tts(a.url, b.url, seed=5)
    marked: list[float] = []
    mark_full = tts.endpoints.mark_full
    tts.endpoints.mark_full = lambda ep, after: (marked.append(after), mark_full(ep, after))
    try:
        stream, audio = await _speak(tts, conn=APIConnectOptions(max_retry=0, timeout=30))
    finally:
        await tts.aclose()
    report = stream.text_streams[0]
    assert stream.attempts == 1
    assert report.endpoints == [a.url, b.url] and report.full == [a.url]
    assert marked == [retry_after]
    ep_a = tts.endpoints.endpoints[0]
    assert ep_a.healthy and ep_a.failures == 0 and ep_a.rejections == 1
    np.testing.assert_array_equal(audio, reference(WORDS, 5))


async def test_every_engine_full_raises_429_once_each_was_tried(sockets):
    a, b = sockets
    a.fault, b.fault = "full", "full_upgrade"
    tts = _tts(a.url, b.url, seed=5)
    try:
        with pytest.raises(APIStatusError) as e:
            await _speak(tts, conn=APIConnectOptions(max_retry=0, timeout=30))
    finally:
        await tts.aclose()
    assert e.value.status_code == 429 and e.value.retryable
    assert len(a.sessions) == 1 and b.refused == 1  # each engine once


FIRST, SECOND = "The first sentence is right here.", "And then the second one follows it."


async def test_max_new_tokens_caps_each_sentence_so_each_is_an_utterance(sockets):
    """`max_new_tokens` caps each sentence on the sentence path; the engine caps a socket's
    utterance as a whole, so under a cap each sentence of a streamed segment is an utterance of
    its own (streamed as it comes, with the cap); without one the segment is one utterance."""
    a, _ = sockets
    tts = _tts(a.url, seed=4, max_new_tokens=30)
    try:
        stream, audio = await _speak(tts, f"{FIRST} {SECOND}".split())
    finally:
        await tts.aclose()
    assert [s["text"].strip() for s in a.sessions] == [FIRST, SECOND]
    assert [s["start"]["max_new_tokens"] for s in a.sessions] == [30, 30]
    assert [r.ended_early for r in stream.text_streams] == [False, False]
    np.testing.assert_array_equal(audio, np.concatenate([reference(FIRST.split(), 4),
                                                         reference(SECOND.split(), 4)]))  # fmt: skip

    tts = _tts(a.url, seed=4)
    try:
        stream, _ = await _speak(tts, f"{FIRST} {SECOND}".split())
    finally:
        await tts.aclose()
    assert a.sessions[-1]["text"].strip() == f"{FIRST} {SECOND}" and len(stream.text_streams) == 1
    assert "max_new_tokens" not in a.sessions[-1]["start"]


@pytest.mark.parametrize("capped", [True, False], ids=["max_new_tokens", "no_cap"])
async def test_an_utterance_ended_before_its_text_is_in_drops_no_words_silently(sockets, capped):
    """The engine ends an utterance while its text is still coming (a frame cap does). Under
    `max_new_tokens` that is the sentence's cap, as on the sentence path: the next sentence goes
    on as an utterance of its own, and the stream emits its one `metrics_collected` (LiveKit's
    contract). Without a cap the words the engine did not get raise an APIError."""
    a, _ = sockets
    a.fault = "done_early"
    tts = _tts(a.url, seed=6, **({"max_new_tokens": 40} if capped else {}))
    metrics: list = []
    tts.on("metrics_collected", metrics.append)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=0, timeout=30))
    audio: list[np.ndarray] = []

    async def feed() -> None:
        stream.push_text("The first sentence ")
        await a.ended_early.wait()  # its first word spoken, the rest of the text still open
        a.fault = None
        stream.push_text(f"is right here. {SECOND}")
        stream.end_input()

    feeder = asyncio.create_task(feed())
    try:
        async with asyncio.timeout(HANG_GUARD):
            if not capped:
                with pytest.raises(APIError, match="before its text was all in"):
                    async for _ in stream:
                        pass
                assert len(a.sessions) == 1
                return
            async for ev in stream:
                if (data := pcm(ev)) is not None:
                    audio.append(data)
            await feeder
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await stream.aclose()
        await tts.aclose()
    assert [s["text"].split()[0] for s in a.sessions] == ["The", "And"]
    assert a.sessions[1]["text"].strip() == SECOND and a.sessions[1]["ended"]
    assert [r.ended_early for r in stream.text_streams] == [True, False]
    first_word = np.frombuffer(word_pcm(0, "The", 6), np.int16)
    np.testing.assert_array_equal(np.concatenate(audio),
                                  np.concatenate([first_word, reference(SECOND.split(), 6)]))  # fmt: skip
    assert len(metrics) == 1, f"expected 1 metrics collected event, got {len(metrics)}"
