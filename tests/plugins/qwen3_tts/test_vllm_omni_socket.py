"""The plugin in vLLM-Omni's socket dialect (`protocol="vllm-omni"`, streamed text) against the
REAL engine's implementation of that dialect (127.0.0.1, the tiny checkpoint whose utterances end
by EOS): `session.config` (with the seed), `input.text` as the LLM writes, `input.done` at the end
of a reply; three replies over one warm connection (the engine's
`qwen3_tts_socket_connections_total{protocol="vllm_omni"}`), each the engine's dual-track
synthesis of the whole text; a barge-in closes the socket (the dialect has no cancel) and the next
reply is whole on a new one; an engine of one dialect SIGKILLed mid-reply fails over to an engine
of the other, sample-exact (same seed); a vLLM-Omni without the socket (404 at the upgrade) gets
sentences under "auto". Order by events (audio received, a process killed), never by time.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.plugins.qwen3_tts.test_text_stream import (
    HANG_GUARD,
    _post_dual,
    _same_audio,
    _speak,
    _tokens,
    _tts,
)
from tests.support.engine_process import EngineProcess, free_port
from tests.support.tts_audio import pcm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
REPLIES = ["Hello there, how are you?", "I can help with that.", "Goodbye for now."]


async def _connections(url: str, protocol: str = "vllm_omni") -> int:
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        text = (await c.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "qwen3_tts_socket_connections":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")
                           and s.labels.get("protocol") == protocol))  # fmt: skip
    return 0


async def _ready(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _until(condition) -> None:
    async with asyncio.timeout(HANG_GUARD):
        while not condition():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("text_input", ["stream", "auto"])
async def test_three_streamed_replies_over_one_vllm_omni_connection(engine, text_input):
    """prewarm() opens the socket; three replies are spoken on it in vLLM-Omni's dialect, each
    warm, each the engine's dual-track synthesis of its whole text with the seed sent in
    `session.config`; the engine counts one connection of that dialect and none of ours."""
    url = f"http://127.0.0.1:{engine.port}"
    before, ours = await _connections(url), await _connections(url, "speech_stream")
    tts = _tts([url], protocol="vllm-omni", text_input=text_input, first_chunk_frames=2)
    try:
        tts.prewarm()
        await _until(lambda: tts.sockets.parked(url))
        assert await _connections(url) == before + 1  # before any reply
        streams = []
        for text in REPLIES:
            streams.append(await asyncio.wait_for(_speak(tts, _tokens(text)), HANG_GUARD))
        assert await _connections(url) == before + 1 and tts.sockets.opened == 1
        assert await _connections(url, "speech_stream") == ours
    finally:
        await tts.aclose()
    for text, (stream, audio) in zip(REPLIES, streams, strict=True):
        assert stream.sentences == []  # streamed, not sentence requests
        [report] = stream.text_streams
        assert report.warm is True and report.text == text and report.endpoints == [url]
        assert report.finish_reason == "stop"
        _same_audio(audio, await _post_dual(url, text, 7, 2))


async def test_a_barge_in_closes_the_vllm_omni_socket_and_the_next_reply_is_whole(engine):
    """Interrupted after its first audio, text still open: the dialect has no cancel, so the
    socket is closed (the engine stops that utterance); the next reply opens a new socket."""
    url = f"http://127.0.0.1:{engine.port}"
    before = await _connections(url)
    tts = _tts([url], protocol="vllm-omni", text_input="stream", first_chunk_frames=2)
    handler = engine.engine.active
    seen = len(handler.history)
    try:
        interrupted = tts.stream()
        interrupted.push_text("This reply is cut short by the caller, who ")
        async with asyncio.timeout(HANG_GUARD):
            async for ev in interrupted:
                if (data := pcm(ev)) is not None and len(data):
                    break  # first audio; the text is still open
        await interrupted.aclose()
        stream, audio = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[1])), HANG_GUARD)
        assert await _connections(url) == before + 2 and tts.sockets.opened == 2
    finally:
        await tts.aclose()
    assert stream.text_streams[0].warm is False
    _same_audio(audio, await _post_dual(url, REPLIES[1], 7, 2))
    await _until(lambda: len(handler.history) >= seen + 2)
    assert list(handler.history)[seen]["cancelled"]  # the engine stopped the interrupted one


@pytest.mark.parametrize("dialects", [("vllm-omni", "qwen3-tts"), ("qwen3-tts", "vllm-omni")])
async def test_a_reply_fails_over_between_engines_of_each_dialect_sample_exact(
    tiny_checkpoint, dialects
):  # fmt: skip
    """Engine a (first dialect) is SIGKILLed after the first audio, half the text sent; the
    reply moves to engine b (the other dialect) with the text so far and the same seed, and is
    b's synthesis of the whole text: nothing lost, nothing twice."""
    ckpt = tiny_checkpoint("custom_voice", eos="text")
    a, b = EngineProcess(ckpt), EngineProcess(ckpt)
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away."
    try:
        await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
        tts = _tts([a.url, b.url], seed=None, protocol=list(dialects), text_input="stream",
                   first_chunk_frames=2)  # fmt: skip

        async def kill_a(heard: asyncio.Event) -> None:
            await heard.wait()
            await asyncio.to_thread(a.kill)

        try:
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(text), kill_a), HANG_GUARD)
            b_protocol = "vllm_omni" if dialects[1] == "vllm-omni" else "speech_stream"
            assert await _connections(b.url, b_protocol) == 1
        finally:
            await tts.aclose()
        [report] = stream.text_streams
        reference = await _post_dual(b.url, text, report.seed, 2)
    finally:
        a.stop(), b.stop()
    assert report.endpoints == [a.url, b.url] and report.text == text
    assert report.skipped_bytes > 0 and stream.attempts == 1
    _same_audio(audio, reference)


async def test_auto_speaks_sentences_to_a_vllm_omni_without_the_socket():
    """A vLLM-Omni stand-in (127.0.0.1) with POST only: "auto" tries the upgrade, meets 404,
    and speaks the segment as sentence requests; the next reply does not try again."""
    posts: list[dict] = []
    upgrades = 0

    async def speech(request: web.Request) -> web.StreamResponse:
        posts.append(await request.json())
        return web.Response(body=np.full(4800, 1000, np.int16).tobytes())

    async def stream_route(request: web.Request) -> web.Response:
        nonlocal upgrades
        upgrades += 1
        return web.Response(status=404)

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/audio/speech/stream", stream_route)
    app.router.add_get("/ready", _ready)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    tts = _tts([url], protocol="vllm-omni", first_clause_chunk_frames=None)
    try:
        for text in REPLIES[:2]:
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(text)), HANG_GUARD)
            assert stream.text_streams == [] and [s.text for s in stream.sentences] == [text]
            assert len(audio) == 4800
    finally:
        await tts.aclose()
        await runner.cleanup()
    assert upgrades == 1 and [p["input"] for p in posts] == REPLIES[:2]
    assert "seed" not in posts[0]  # vLLM-Omni's POST fields only


class IdleOmni:
    """A stand-in for a real vLLM-Omni's socket (127.0.0.1; vLLM-Omni needs a GPU): its
    dialect as `serving_speech_stream.py` speaks it, with its idle rule: a socket that sends no
    message for `idle_s` gets an error and is closed. Each flush with text is one sentence of
    noise; an empty flush is answered by `session.done` at once."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s, self.port, self.connections, self.idle_closes = idle_s, free_port(), 0, 0
        app = web.Application()
        app.router.add_get("/ready", _ready)
        app.router.add_get("/v1/audio/speech/stream", self._stream)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)

    async def start(self) -> IdleOmni:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        text, flush = "", 0
        while True:
            try:
                msg = await asyncio.wait_for(ws.receive(), self.idle_s)
            except TimeoutError:
                self.idle_closes += 1
                await ws.send_json(
                    {"type": "error", "message": "Idle timeout: no message received"}
                )
                await ws.close()
                return ws
            if msg.type != web.WSMsgType.TEXT:
                return ws
            event = msg.json()
            if event["type"] == "input.text":
                text += event["text"]
            elif event["type"] == "input.done":
                if text.strip():
                    head = {"utterance_index": flush, "sentence_index": 0}
                    await ws.send_json({"type": "audio.start", **head, "sentence_text": text,
                                        "format": "pcm"})  # fmt: skip
                    await ws.send_bytes(np.full(4800, 1000, np.int16).tobytes())
                    await ws.send_json({"type": "audio.done", **head})
                await ws.send_json({"type": "session.done", "utterance_index": flush,
                                    "total_sentences": int(bool(text.strip()))})  # fmt: skip
                text, flush = "", flush + 1


async def test_a_parked_vllm_omni_socket_outlives_the_servers_idle_timeout_by_empty_flushes():
    """vLLM-Omni closes a socket silent for its idle timeout (30 s; 2 s here): parked, the
    plugin's socket sends an empty `input.done` (here every 0.1 s, 15 s by default) and reads
    the `session.done` answers; after more keepalives than the idle timeout spans, the next
    reply is spoken on the same socket, its own `session.done` told from theirs by its index."""
    server = await IdleOmni(idle_s=2.0).start()
    url = f"http://127.0.0.1:{server.port}"
    tts = _tts([url], protocol="vllm-omni", text_input="stream")
    tts.sockets.omni_keepalive_s = 0.1
    try:
        for i, text in enumerate(REPLIES[:2]):
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(text)), HANG_GUARD)
            assert len(audio) == 4800 and stream.text_streams[0].warm is (i > 0)
            if i == 0:
                [sock] = tts.sockets.parked(url)
                await _until(lambda s=sock: s.keepalives >= 30)  # 3 s of them: past the 2 s idle
        assert tts.sockets.opened == 1 and server.connections == 1 and server.idle_closes == 0
    finally:
        await tts.aclose()
        await server._runner.cleanup()
