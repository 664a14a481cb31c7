"""A warm socket's utterances are traced in their callers' traces: each utterance's start carries
its own W3C `traceparent` (the socket was opened earlier, e.g. by the plugin's prewarm(), with
no trace of its own), and the engine's `qwen3_tts.utterance` span of it is a child of that span,
with its frames and its `qwen3_tts.queue` / `qwen3_tts.synthesis` children. A real engine process
exporting OTLP/HTTP to a collector on loopback; the only waits are for events (spans exported)."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
import pytest

from tests.support.engine_process import EngineProcess
from tests.support.otlp_collector import OTLPCollector
from tests.support.speech_socket import HANG_GUARD, utterance

pytestmark = pytest.mark.slow
API_KEY = "trace-key"
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 5}


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def _spans(collector: OTLPCollector, name: str, n: int) -> list:
    async with asyncio.timeout(HANG_GUARD):
        while len(collector.named(name)) < n:
            await asyncio.sleep(0.1)
    return collector.named(name)


async def test_each_utterance_of_a_warm_socket_is_a_child_of_its_own_callers_span(tiny_checkpoint):
    collector = await OTLPCollector().start()
    env = {"QWEN3_TTS_API_KEY": API_KEY, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    engine = await asyncio.to_thread(
        EngineProcess(tiny_checkpoint("custom_voice", eos="text"), None, "--no-governor",
                      env=env).start, HANG_GUARD)  # fmt: skip
    try:
        callers = [_traceparent(), _traceparent()]
        url = f"ws://127.0.0.1:{engine.port}/v1/audio/speech/stream"
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(
                url,
                protocols=("qwen3-tts.speech.v1",),
                headers={"Authorization": f"Bearer {API_KEY}"},
            ) as ws,
        ):  # no traceparent on the upgrade: a socket opened ahead of its turns
            for (traceparent, _, _), text in zip(
                callers, ["Hello there.", "Goodbye now."], strict=True
            ):
                events = await utterance(ws, {**START, "traceparent": traceparent}, [text])
                assert events[-1]["type"] == "response.done", events[-1]
        spans = await _spans(collector, "qwen3_tts.utterance", 2)
        sockets = await _spans(collector, "qwen3_tts.speech_stream", 1)
        assert sockets[0].attributes["qwen3_tts.utterances"] == 2
        by_request = sorted(spans, key=lambda s: s.attributes["qwen3_tts.request_id"])
        for (_, trace_id, parent), span in zip(callers, by_request, strict=True):
            assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
            assert span.attributes["qwen3_tts.frames"] > 0
            assert span.attributes["qwen3_tts.outcome"] == "200"
            children = {s.name for s in collector.spans if s.parent_span_id == span.span_id}
            assert children == {"qwen3_tts.queue", "qwen3_tts.synthesis"}, children
        assert all(s.trace_id != sockets[0].trace_id for s in spans)  # not the socket's trace
    finally:
        await asyncio.to_thread(engine.stop)
        await collector.stop()
