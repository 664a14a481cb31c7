"""The plugin's warm socket against the REAL engine (127.0.0.1, the tiny checkpoint whose utterances
end by EOS): a call of several replies is one WebSocket connection (the engine's
`qwen3_tts_socket_connections_total`), opened by `prewarm()` before the first reply; a barge-in
cancels on the socket and the next reply reuses it; a socket the engine closed while idle (its
`ws_keepalive_timeout_s`) is replaced and the next reply is whole; an engine SIGKILLed mid-call
is failed over sample-exact and the call goes on warm on the next engine.
Order is shown by events (a socket parked, audio received, a process killed), never by time.
The fault-injection twin of these tests: test_text_socket_failover.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.plugins.qwen3_tts.test_text_stream import (
    HANG_GUARD,
    _post_dual,
    _same_audio,
    _speak,
    _tokens,
    _tts,
)
from tests.support.engine_process import EngineProcess
from tests.support.speech_socket import engine_server
from tests.support.tts_audio import pcm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
REPLIES = ["Hello there, how are you?", "I can help with that.", "Goodbye for now."]


async def _connections(url: str) -> int:
    """The engine's `qwen3_tts_socket_connections_total` of the speech-stream route."""
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        text = (await c.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "qwen3_tts_socket_connections":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")
                           and s.labels.get("protocol") == "speech_stream"))  # fmt: skip
    return 0


async def _until(condition) -> None:
    """Wait for `condition()` (an event the test cannot await directly), bounded by a hang."""
    async with asyncio.timeout(HANG_GUARD):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_call_of_three_replies_is_one_connection_opened_by_prewarm(engine):
    """prewarm() opens the socket before the first reply (the engine has counted it, and it
    waits in the pool); the three replies of the call are spoken on it, each warm, and the
    engine counts one connection for the call; each reply says what POST says (same seed)."""
    url = f"http://127.0.0.1:{engine.port}"
    before = await _connections(url)
    tts = _tts([url], first_chunk_frames=2)
    try:
        tts.prewarm()
        await _until(lambda: tts.sockets.parked(url))
        assert await _connections(url) == before + 1  # before any reply
        streams = []
        for text in REPLIES:
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(text)), HANG_GUARD)
            streams.append((stream, audio))
        assert await _connections(url) == before + 1 and tts.sockets.opened == 1
    finally:
        await tts.aclose()
    ids = set()
    for text, (stream, audio) in zip(REPLIES, streams, strict=True):
        [report] = stream.text_streams
        assert report.warm is True and report.text == text and report.endpoints == [url]
        ids.update(report.request_ids)
        _same_audio(audio, await _post_dual(url, text, 7, 2))
    assert len(ids) == 3  # each utterance its own id on the one socket


async def test_a_barge_in_cancels_and_the_next_reply_reuses_the_socket(engine):
    """The first reply is interrupted after its first audio, its text still open (LiveKit closes
    the stream): the plugin sends `response.cancel`, the engine answers `response.done`, and the
    socket goes back to the pool; the next reply is spoken whole on it."""
    url = f"http://127.0.0.1:{engine.port}"
    before = await _connections(url)
    tts = _tts([url], first_chunk_frames=2)
    try:
        interrupted = tts.stream()
        interrupted.push_text("This reply is cut short by the caller, who ")
        async with asyncio.timeout(HANG_GUARD):
            async for ev in interrupted:
                if (data := pcm(ev)) is not None and len(data):
                    break  # first audio; the text is still open
        await interrupted.aclose()
        stream, audio = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[1])), HANG_GUARD)
        assert await _connections(url) == before + 1 and tts.sockets.opened == 1
    finally:
        await tts.aclose()
    assert stream.text_streams[0].warm is True
    _same_audio(audio, await _post_dual(url, REPLIES[1], 7, 2))


async def test_a_socket_the_engine_closed_while_idle_is_replaced(tiny_checkpoint):
    """An engine with a short `ws_keepalive_timeout_s` closes the parked socket (1000, no error
    event); the next reply opens a new one and is whole."""
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(model, 1, ws_keepalive_timeout_s=2.0) as server:
        url = f"http://127.0.0.1:{server.port}"
        tts = _tts([url], first_chunk_frames=2)
        try:
            await asyncio.wait_for(_speak(tts, _tokens(REPLIES[0])), HANG_GUARD)
            [sock] = tts.sockets.parked(url)
            await asyncio.wait_for(sock.wait_closed(), HANG_GUARD)  # the engine's keepalive
            assert sock.ws.close_code == 1000 and not sock.alive
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[1])), HANG_GUARD)
            assert await _connections(url) == 2 and tts.sockets.opened == 2
        finally:
            await tts.aclose()
        [report] = stream.text_streams
        assert report.warm is False and report.endpoints == [url]
        _same_audio(audio, await _post_dual(url, REPLIES[1], 7, 2))


async def test_an_idle_socket_is_retired_by_the_plugin_before_the_engine_would(tiny_checkpoint):
    """The plugin's idle bound (`socket_max_idle`) below the engine's keepalive: the parked
    socket's own reader closes it (the plugin's `retired` event, its close reason; the engine had
    sent no close, or the reader would have returned on it), it leaves the pool at once, and the
    next reply opens a fresh socket and is whole."""
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(model, 1, ws_keepalive_timeout_s=HANG_GUARD * 10) as server:
        url = f"http://127.0.0.1:{server.port}"
        tts = _tts([url], first_chunk_frames=2, socket_max_idle=0.5)
        try:
            await asyncio.wait_for(_speak(tts, _tokens(REPLIES[0])), HANG_GUARD)
            [sock] = tts.sockets.parked(url)
            await asyncio.wait_for(sock.wait_closed(), HANG_GUARD)  # the plugin's idle bound
            assert sock.retired and tts.sockets.retired == 1 and not sock.alive
            assert tts.sockets.parked(url) == []  # out of the pool now, not at the next get()
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[1])), HANG_GUARD)
            assert await _connections(url) == 2 and tts.sockets.opened == 2
        finally:
            await tts.aclose()
        [report] = stream.text_streams
        assert report.warm is False and report.endpoints == [url]
        _same_audio(audio, await _post_dual(url, REPLIES[1], 7, 2))


async def test_an_engine_killed_mid_call_is_failed_over_and_the_call_stays_warm(tiny_checkpoint):
    """Engine a speaks the first reply on the prewarmed socket; during the second it is
    SIGKILLed after the first audio, text still open: the reply moves to b, the text so far
    replayed with the same seed, and is b's synthesis of the whole text (nothing lost, nothing
    twice); the third reply is spoken on b's socket, already open."""
    ckpt = tiny_checkpoint("custom_voice", eos="text")
    a, b = EngineProcess(ckpt), EngineProcess(ckpt)
    try:
        await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
        tts = _tts([a.url, b.url], seed=None, first_chunk_frames=2)  # the agent's: no seed

        async def kill_a(heard: asyncio.Event) -> None:
            await heard.wait()
            await asyncio.to_thread(a.kill)

        try:
            tts.prewarm()
            await _until(lambda: tts.sockets.parked(a.url))
            first, _ = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[0])), HANG_GUARD)
            text = "The quick brown fox jumps over the lazy dog, and then it runs far away."
            killed, audio = await asyncio.wait_for(_speak(tts, _tokens(text), kill_a), HANG_GUARD)
            third, _ = await asyncio.wait_for(_speak(tts, _tokens(REPLIES[2])), HANG_GUARD)
            assert await _connections(b.url) == 1 and tts.sockets.opened == 2
        finally:
            await tts.aclose()
        report = killed.text_streams[0]
        reference = await _post_dual(b.url, text, report.seed, 2)
    finally:
        a.stop(), b.stop()
    assert first.text_streams[0].warm is True and first.text_streams[0].endpoints == [a.url]
    assert report.endpoints == [a.url, b.url] and report.warm is True and report.text == text
    assert report.skipped_bytes > 0 and killed.attempts == 1
    _same_audio(audio, reference)
    assert third.text_streams[0].endpoints == [b.url] and third.text_streams[0].warm is True
