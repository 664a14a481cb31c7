"""Failover and errors of the streaming-text socket (`text_socket.py`), against faults injected on
real WebSockets (127.0.0.1).

`FaultSocketEngine` speaks the engine's streaming-text protocol (`/v1/audio/speech/stream`,
subprotocol qwen3-tts.speech.v1, status `streaming_text: true`) with audio that is a pure function
of (the words so far, seed), so a replay on another endpoint says the same as the first did, as
the real engine does (its equivalence tests); it fails on demand: a socket closed before the
first audio, an error event (503 or 400), a connection cut mid-audio, or a peer that stops
reading (no pong) while the text is still open. The real engine's socket: test_text_stream.py.
"""

from __future__ import annotations

import asyncio
import json
import zlib

import httpx
import numpy as np
import pytest
from aiohttp import web
from livekit.agents import APIConnectOptions, APIStatusError
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
        self.fault: str | None = None  # close | error503 | error400 | cut | stall
        self.cut_after = 2 * len(word_pcm(0, "x", 0)) + 1001  # audio bytes before a cut: odd
        self.sessions: list[dict] = []  # per socket: start message, text, ended, closed
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

    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SPEECH_STREAM_SUBPROTOCOL,))
        await ws.prepare(request)
        session = {"start": None, "text": "", "ended": False, "open": True}
        self.sessions.append(session)
        try:
            return await self._speak(request, ws, session)
        finally:  # also when the client's close cancels this handler
            session["open"] = False

    async def _speak(self, request: web.Request, ws: web.WebSocketResponse, session: dict):
        spoken, sent = 0, 0
        async for msg in ws:
            event = json.loads(msg.data)
            kind = event["type"]
            if kind == "session.start":
                session["start"] = event
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
                continue
            if kind == "input_text.append":
                session["text"] += event["text"]
            elif kind == "input_text.end":
                session["ended"] = True
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
            spoken = len(words)
            if session["ended"]:
                await ws.send_json({"type": "response.done", "frames": 0, "samples": sent // 2,
                                    "text_tokens": spoken})  # fmt: skip
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
    conn = APIConnectOptions(max_retry=0, timeout=1.0)  # the heartbeat's bound on a silent peer
    try:
        stream, audio = await _speak(tts, conn=conn)
    finally:
        await tts.aclose()
    report = stream.text_streams[0]
    assert report.endpoints == [a.url, b.url]
    assert "Stalled" in (tts.endpoints.endpoints[0].last_error or "")
    np.testing.assert_array_equal(audio, reference(WORDS, 3))


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


async def test_closing_the_stream_closes_the_socket(sockets):
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
        async with asyncio.timeout(HANG_GUARD):
            while a.sessions[0]["open"]:
                await asyncio.sleep(0.02)
    finally:
        await tts.aclose()
    assert not a.sessions[0]["ended"]


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
