"""`qwen3-tts serve --no-loop-detector` reaches the worker, and the finish reason is in the trace:
a real engine process on the looping tiny checkpoint (`eos="loop"`) runs a looping utterance to
its request cap, past the detector's window ("length", not "repetition"), and its
`qwen3_tts.speech` span, exported over OTLP/HTTP to a collector on loopback, carries
`qwen3_tts.finish_reason`. The only waits are for events (a response, spans exported)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from qwen3_tts_engine.protocol import FRAME_SAMPLES, HEADER_FINISH_REASON, HEADER_REQUEST_ID
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES
from tests.support.engine_process import EngineProcess
from tests.support.otlp_collector import OTLPCollector

pytestmark = pytest.mark.slow
HANG_GUARD = 120
FRAMES = DEFAULT_LOOP_RULES.window + 4  # past the window the detector would have ended it at


async def test_switched_off_a_loop_runs_to_its_cap_and_its_span_says_length(tiny_checkpoint):
    collector = await OTLPCollector().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    engine = await asyncio.to_thread(
        EngineProcess(tiny_checkpoint("custom_voice", eos="loop"), None, "--no-governor",
                      "--no-loop-detector", env=env).start, HANG_GUARD)  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=engine.url, timeout=HANG_GUARD) as c:
            r = await c.post("/v1/audio/speech", json={
                "input": "Hello there.", "voice": "ryan", "language": "english", "seed": 1,
                "response_format": "pcm", "max_new_tokens": FRAMES})  # fmt: skip
        assert r.status_code == 200, r.text
        assert len(r.content) == FRAMES * FRAME_SAMPLES * 2
        assert r.headers[HEADER_FINISH_REASON] == "length"
        async with asyncio.timeout(HANG_GUARD):
            while not (spans := collector.named("qwen3_tts.speech")):
                await asyncio.sleep(0.1)
        (span,) = spans
        assert span.attributes["qwen3_tts.request_id"] == r.headers[HEADER_REQUEST_ID]
        assert span.attributes["qwen3_tts.finish_reason"] == "length"
    finally:
        await asyncio.to_thread(engine.stop)
        await collector.stop()
