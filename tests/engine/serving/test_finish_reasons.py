"""Every ending says why (issue 51, item 2) on `POST /v1/audio/speech`: `X-Finish-Reason` on a
whole response, `finish_reason` in the SSE `speech.audio.done`, and
`qwen3_tts_utterances_finished_total{reason}` in /metrics, counted once per utterance.

Engines in process on tiny checkpoints: the `engine` fixture's ends by EOS ("stop"); `eos="loop"`
never ends and cycles two codes, so the loop detector ends it ("repetition") after its window,
a request cap before that is "length", a client that goes away "abort", a worker killed
mid-stream "error". Orders by events (a chunk received, a counter that moved); frames, not time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qwen3_tts_engine.cli import build_parser, engine_config
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.protocol import (
    FINISH_REASONS,
    FRAME_SAMPLES,
    HEADER_CAPPED,
    HEADER_FINISH_REASON,
    default_max_new_tokens,
)
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES
from tests.engine.serving.test_frame_cap import _sse_done  # BODY and client as here

HANG_GUARD = 120
TEXT = "Hello there, how are you doing today?"  # its default cap is far above the window
BODY = {"voice": "ryan", "language": "english", "seed": 3, "response_format": "pcm"}
FINISHED = "qwen3_tts_utterances_finished_total"
WINDOW = DEFAULT_LOOP_RULES.window


@pytest.fixture(scope="module")
async def looping(tiny_checkpoint):
    """An engine whose talker loops (the detector on, as `qwen3-tts serve` runs it)."""
    checkpoint = str(tiny_checkpoint("custom_voice", eos="loop"))
    handler = Handler(checkpoint, max_batch=2)
    srv = EngineServer(Engine(checkpoint, [handler]), ServerConfig(port=0))
    await srv.start()
    srv.test_handler = handler
    yield srv
    await srv.stop()


def _client(srv) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=HANG_GUARD)


async def _finished(srv) -> dict[str, float]:
    async with _client(srv) as c:
        text = (await c.get("/metrics")).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == FINISHED}  # fmt: skip


async def _counted(srv, before: dict[str, float], reason: str) -> dict[str, float]:
    """The counters once `reason`'s has moved (a bounded wait for an event, not a time)."""
    async with asyncio.timeout(HANG_GUARD):
        while (now := await _finished(srv))[reason] == before[reason]:
            await asyncio.sleep(0.05)
    return now


def _moved(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


async def _post(srv, **body) -> httpx.Response:
    async with _client(srv) as c:
        return await c.post("/v1/audio/speech", json={**BODY, **body})


# -- stop: end of speech ---------------------------------------------------------------------


@pytest.mark.slow
async def test_an_utterance_that_ends_by_eos_says_stop(engine):
    before = await _finished(engine)
    assert set(before) == set(FINISH_REASONS)  # every reason's series exists from the start
    r = await _post(engine, input="Hello there.")
    assert r.status_code == 200 and r.headers[HEADER_FINISH_REASON] == "stop"
    assert HEADER_CAPPED not in r.headers
    _, done = await _sse_done(engine, input="Hello there.")
    assert done["finish_reason"] == "stop" and done["capped"] is False
    # counted before each response went out, once each
    assert _moved(before, await _finished(engine)) == {"stop": 2}


# -- length, repetition, abort, error on a looping model ---------------------------------------


@pytest.mark.slow
async def test_a_cap_reached_before_the_loop_is_seen_says_length(looping):
    before = await _finished(looping)
    r = await _post(looping, input=TEXT, max_new_tokens=6)
    assert r.status_code == 200, r.text
    assert len(r.content) == 6 * FRAME_SAMPLES * 2
    assert r.headers[HEADER_FINISH_REASON] == "length" and r.headers[HEADER_CAPPED] == "true"
    assert _moved(before, await _finished(looping)) == {"length": 1}


@pytest.mark.slow
async def test_a_looping_utterance_ends_as_repetition_well_before_its_cap(looping):
    before = await _finished(looping)
    samples, done = await _sse_done(looping, input=TEXT)
    assert done["finish_reason"] == "repetition" and done["capped"] is False
    assert samples == WINDOW * FRAME_SAMPLES  # one window of frames
    assert done["usage"]["output_tokens"] == WINDOW < default_max_new_tokens(TEXT) // 2
    assert _moved(before, await _finished(looping)) == {"repetition": 1}


@pytest.mark.slow
async def test_a_client_that_goes_away_is_counted_as_abort(looping):
    before = await _finished(looping)
    reader, writer = await asyncio.open_connection("127.0.0.1", looping.port)
    body = json.dumps({**BODY, "input": TEXT, "stream": True}).encode()
    writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: engine\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    async with asyncio.timeout(HANG_GUARD):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.read(1)  # the first audio
    writer.transport.abort()  # the client leaves mid-utterance
    after = await _counted(looping, before, "abort")
    assert _moved(before, after) == {"abort": 1}


@pytest.mark.slow
async def test_a_worker_that_dies_mid_stream_is_counted_as_error(looping):
    """Near the end of this module: the worker is killed (the handler starts another)."""
    before = await _finished(looping)
    with pytest.raises(httpx.HTTPError):  # the connection is cut: audio went out already
        async with _client(looping) as c, c.stream("POST", "/v1/audio/speech",
                                                   json={**BODY, "input": TEXT,
                                                         "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                os.kill(looping.test_handler.pid, signal.SIGKILL)
    after = await _counted(looping, before, "error")
    assert _moved(before, after) == {"error": 1}


# -- the off switch reaches the worker ----------------------------------------------------------


def test_serve_has_a_flag_that_switches_the_detector_off():
    serve = ["serve", "--model", "/nonexistent/checkpoint"]  # nothing is loaded here
    on = engine_config(build_parser().parse_args(serve))
    off = engine_config(build_parser().parse_args([*serve, "--no-loop-detector"]))
    assert on.loop_detector and not off.loop_detector
    assert on.handler(None).loop_detector and not off.handler(None).loop_detector
    assert not off.handler(None).sibling("q8").loop_detector  # a swap's worker keeps it off


@pytest.mark.slow
async def test_a_whole_response_the_engine_fails_says_error(looping):
    """After the test above: the handler's new worker is waited for, then killed too."""
    handler = looping.test_handler
    async with asyncio.timeout(HANG_GUARD):
        while handler.state != "ready":
            await asyncio.sleep(0.05)
    before = await _finished(looping)
    post = asyncio.ensure_future(_post(looping, input=TEXT))
    async with asyncio.timeout(HANG_GUARD):
        while handler.in_flight == 0:  # its synthesis started
            await asyncio.sleep(0.01)
    os.kill(handler.pid, signal.SIGKILL)
    r = await post
    assert r.status_code == 503 and r.headers[HEADER_FINISH_REASON] == "error"
    assert _moved(before, await _finished(looping)) == {"error": 1}
