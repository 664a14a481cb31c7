"""The plugin warns when the engine says an utterance ran to its frame cap (`response.done`'s
`"capped": true`: it never ended by itself), and only then. A loopback streaming-text server
(127.0.0.1) answers every utterance with some audio and a `response.done` whose `capped` the test
sets; the real engine's flag: tests/engine/serving/test_frame_cap.py."""

from __future__ import annotations

import asyncio
import logging

import httpx
import numpy as np
import pytest
from aiohttp import web
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES, SPEECH_STREAM_SUBPROTOCOL
from tests.support.engine_process import free_port
from tests.support.tts_audio import stream_text

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
HANG_GUARD = 60.0


class CapEngine:
    """Speaks every utterance as 2 frames of noise, then `response.done` with `capped`."""

    def __init__(self, capped: bool) -> None:
        self.capped = capped
        self.port = free_port()
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/engine/status", self._status)
        app.router.add_get("/v1/audio/speech/stream", self._stream)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)

    async def start(self) -> CapEngine:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"handlers": [], "streaming_text": True})

    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SPEECH_STREAM_SUBPROTOCOL,))
        await ws.prepare(request)
        async for msg in ws:
            kind = msg.json()["type"]
            if kind == "session.start":
                await ws.send_json({"type": "session.created", "id": "s1", "sample_rate": 24000,
                                    "variant": "fake"})  # fmt: skip
            elif kind == "input_text.end":
                noise = np.random.default_rng(0).integers(-8000, 8000, 2 * FRAME_SAMPLES, np.int16)
                await ws.send_bytes(noise.tobytes())
                await ws.send_json({"type": "response.done", "frames": 2,
                                    "samples": 2 * FRAME_SAMPLES, "text_tokens": 3,
                                    "capped": self.capped})  # fmt: skip
                await ws.close()
        return ws


@pytest.mark.parametrize("capped", [True, False])
async def test_a_capped_utterance_is_logged_as_a_warning(capped, caplog):
    engine = await CapEngine(capped).start()
    tts = qwen3_tts.TTS(base_url=f"http://127.0.0.1:{engine.port}", voice="ryan", language="en",
                        probe_interval=0.2, timeout=httpx.Timeout(300.0))  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="livekit.plugins.qwen3_tts"):
            async with asyncio.timeout(HANG_GUARD):
                _, audio = await stream_text(tts, ["Hello there friend."])
    finally:
        await tts.aclose()
        await engine._runner.cleanup()
    assert len(audio) == 2 * FRAME_SAMPLES
    warned = [r for r in caplog.records if "frame cap" in r.getMessage()]
    assert len(warned) == (1 if capped else 0), caplog.text
