"""The plugin warns when the engine says an utterance did not end by end of speech, and only then:
`response.done`'s `finish_reason` where the engine names one, else (an older engine) its
`"capped": true` read as "length"; each ending is counted (`TTS.finish_reasons`) and emitted as
the TTS's `"finish_reason"` event. A loopback streaming-text server (127.0.0.1) answers every
utterance with some audio and a `response.done` whose fields the test sets; the real engine's:
test_finish_reasons.py and tests/engine/serving/test_frame_cap.py."""

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

    def __init__(self, capped: bool, finish_reason: str | None = None) -> None:
        self.capped, self.finish_reason = capped, finish_reason
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
                done = {"type": "response.done", "frames": 2, "samples": 2 * FRAME_SAMPLES,
                        "text_tokens": 3, "capped": self.capped}  # fmt: skip
                if self.finish_reason is not None:
                    done["finish_reason"] = self.finish_reason
                await ws.send_json(done)
                await ws.close()
        return ws


@pytest.mark.parametrize(
    ("capped", "said", "reason"),
    [(True, None, "length"), (False, None, "stop"), (True, "length", "length"),
     (False, "repetition", "repetition"), (False, "stop", "stop")],
)  # fmt: skip
async def test_an_ending_that_is_not_end_of_speech_is_logged_as_a_warning(capped, said, reason,
                                                                          caplog):  # fmt: skip
    engine = await CapEngine(capped, said).start()
    tts = qwen3_tts.TTS(base_url=f"http://127.0.0.1:{engine.port}", voice="ryan", language="en",
                        probe_interval=0.2, timeout=httpx.Timeout(300.0))  # fmt: skip
    endings: list[qwen3_tts.Ending] = []
    tts.on("finish_reason", endings.append)
    try:
        with caplog.at_level(logging.WARNING, logger="livekit.plugins.qwen3_tts"):
            async with asyncio.timeout(HANG_GUARD):
                _, audio = await stream_text(tts, ["Hello there friend."])
    finally:
        await tts.aclose()
        await engine._runner.cleanup()
    assert len(audio) == 2 * FRAME_SAMPLES
    assert [e.reason for e in endings] == [reason] and tts.finish_reasons == {reason: 1}
    assert endings[0].request_id == "s1" and endings[0].text.strip() == "Hello there friend."
    warned = [r for r in caplog.records if f"finish_reason={reason}" in r.getMessage()]
    assert len(warned) == (0 if reason == "stop" else 1), caplog.text
    if reason == "length":
        assert "frame cap" in warned[0].getMessage()
