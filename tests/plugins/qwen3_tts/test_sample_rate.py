"""`qwen3_tts.TTS(sample_rate=...)`: the plugin asks the engine for the rate its output needs
(a phone call's 16 or 8 kHz) in every request it builds (HTTP sentences, the socket's
`session.start`), and its LiveKit audio says that rate."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES, SAMPLE_RATE, SAMPLE_RATES
from qwen3_tts_engine import protocol as server
from tests.support.tts_audio import pcm

TEXT = "Hello there, how are you?"
HANG_GUARD = 120


def _tts(url: str = "http://127.0.0.1:9", **kw) -> qwen3_tts.TTS:
    return qwen3_tts.TTS(base_url=url, voice="ryan", language="en", seed=7,
                         timeout=httpx.Timeout(120.0), **kw)  # fmt: skip


async def test_the_rate_is_asked_for_in_every_request_and_reported():
    assert SAMPLE_RATES == server.SAMPLE_RATES
    tts = _tts()
    try:  # the default: 24 kHz, and requests as before (no field: older engines take them)
        assert tts.sample_rate == SAMPLE_RATE == 24000
        assert "sample_rate" not in tts._opts.request_body(TEXT, 7)
        assert "sample_rate" not in tts._opts.stream_start(7)
    finally:
        await tts.aclose()
    for rate in (8000, 16000, 48000):
        tts = _tts(sample_rate=rate)
        try:
            assert tts.sample_rate == rate
            body, start = tts._opts.request_body(TEXT, 7), tts._opts.stream_start(7)
        finally:
            await tts.aclose()
        assert body["sample_rate"] == start["sample_rate"] == rate
        assert server.parse_speech_request(body).sample_rate == rate
        start = {k: v for k, v in start.items() if k != "type"}
        assert server.parse_speech_request(start, text_stream=True).sample_rate == rate


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="sample_rate must be one of"):
        _tts(sample_rate=44100)
    with pytest.raises(ValueError, match="needs protocol='qwen3-tts'"):
        _tts(sample_rate=16000, protocol="vllm-omni")


async def _events(events) -> tuple[set[int], np.ndarray]:
    """The rates LiveKit's frames say, and the audio (int16; its end-of-segment marker out)."""
    rates, audio = set(), []
    async for ev in events:
        rates.add(ev.frame.sample_rate)
        if (data := pcm(ev)) is not None:
            audio.append(data)
    return rates, np.concatenate(audio)


@pytest.mark.slow
@pytest.mark.parametrize("text_input", ["sentences", "stream"])
async def test_a_real_engine_speaks_at_the_rate(engine, text_input):
    """At 8 kHz, `synthesize()` and a stream (HTTP sentences, or the streaming-text socket):
    LiveKit's frames say 8 kHz and the audio is whole 8 kHz codec frames (640 samples for each
    80 ms); `synthesize()` gives the very samples the engine sends a POST at 8 kHz."""
    url = f"http://127.0.0.1:{engine.port}"
    tts = _tts(url, sample_rate=8000, text_input=text_input, first_clause_min_words=0)
    try:
        rates, whole = await asyncio.wait_for(_events(tts.synthesize(TEXT)), HANG_GUARD)
        stream = tts.stream()
        stream.push_text(TEXT)
        stream.end_input()
        try:
            stream_rates, streamed = await asyncio.wait_for(_events(stream), HANG_GUARD)
        finally:
            await stream.aclose()
    finally:
        await tts.aclose()
    assert rates == stream_rates == {8000}
    per_frame = FRAME_SAMPLES * 8000 // SAMPLE_RATE
    assert len(whole) > 0 and len(whole) % per_frame == 0
    assert len(streamed) > 0 and len(streamed) % per_frame == 0
    body = {"model": "qwen3-tts", "input": TEXT, "voice": "ryan", "language": "English", "seed": 7,
            "response_format": "pcm", "sample_rate": 8000}  # fmt: skip
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        r = await c.post(f"{url}/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["X-Sample-Rate"] == "8000"
    np.testing.assert_array_equal(whole, np.frombuffer(r.content, np.int16))


async def test_an_engine_that_ignores_the_rate_fails_the_request_loudly():
    """An engine older than the field answers 24 kHz whatever was asked (its X-Sample-Rate, its
    session.created say so): played at 16 kHz that audio would be slow and low, so the request
    fails with the reason instead, on both transports."""
    from aiohttp import web
    from livekit.agents import APIConnectOptions, APIError

    from tests.plugins.qwen3_tts.test_text_socket_failover import FaultSocketEngine

    async def old_speech(request: web.Request) -> web.Response:  # POST as before the field
        return web.Response(body=b"\0\0" * FRAME_SAMPLES, headers={"X-Sample-Rate": "24000"})

    app = web.Application()
    app.router.add_post("/v1/audio/speech", old_speech)

    async def ready(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    sockets = await FaultSocketEngine().start()  # its session.created says 24000
    conn = APIConnectOptions(max_retry=0, timeout=HANG_GUARD)
    try:
        tts = _tts(f"http://127.0.0.1:{port}", sample_rate=16000)
        try:
            with pytest.raises(APIError, match="does not take `sample_rate`"):
                async with asyncio.timeout(HANG_GUARD):
                    async for _ in tts.synthesize(TEXT, conn_options=conn):
                        pass
        finally:
            await tts.aclose()
        tts = _tts(sockets.url, sample_rate=16000, text_input="stream")
        try:
            stream = tts.stream(conn_options=conn)
            stream.push_text(TEXT)
            stream.end_input()
            with pytest.raises(APIError, match="does not take `sample_rate`"):
                async with asyncio.timeout(HANG_GUARD):
                    async for _ in stream:
                        pass
            await stream.aclose()
        finally:
            await tts.aclose()
    finally:
        await sockets.stop()
        await runner.cleanup()
