"""The engine server over real HTTP on 127.0.0.1, with handlers in worker processes."""

from __future__ import annotations

import asyncio
import io
import math
import os
import signal
import time
import wave

import httpx
import pytest

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.messages import QueryMemory
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    HEADER_VARIANT,
    Limits,
    parse_speech_request,
)
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

pytestmark = pytest.mark.slow
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
async def server(tiny_checkpoint, tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("voices")
    (ref_dir / "me.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 32)
    engine = Engine(str(tiny_checkpoint("custom_voice")),
                    [Handler(str(tiny_checkpoint("custom_voice")), max_queue=2, max_batch=2)])  # fmt: skip
    srv = EngineServer(engine, ServerConfig(port=0, api_key=API_KEY, ref_audio_dir=ref_dir,
                                            max_body_bytes=256 * 1024))  # fmt: skip
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                 timeout=httpx.Timeout(60)) as c:  # fmt: skip
        yield c


def body(text="Hello from the engine.", **kw):
    return {"input": text, "voice": "ryan", "language": "en", "seed": 1, **kw}


async def test_health_ready_models(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    r = await client.get("/ready")
    assert r.status_code == 200 and r.json()["ready"]
    data = (await client.get("/v1/models")).json()["data"][0]
    assert "ryan" in data["voices"] and data["sample_rate"] == 24000


async def test_streamed_pcm_arrives_before_synthesis_ends(server, client):
    """Streaming, not buffering: the first bytes reach the client while the worker is still
    making the utterance's later chunks (its "done" has not come back yet). An order of events
    in this event loop, not a comparison of times."""
    handler = server.engine.active
    frames = 48  # 12 chunks: the worker makes 11 more after the first
    finished_before = len(handler.history)  # one entry per synthesis the worker finished
    done_at_first_bytes = None
    received = 0
    async with client.stream("POST", "/v1/audio/speech",
                             json=body(stream=True, response_format="pcm", max_new_tokens=frames)) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers[HEADER_VARIANT]
        async for data in r.aiter_raw():
            if done_at_first_bytes is None:
                done_at_first_bytes = len(handler.history) > finished_before
            received += len(data)
    assert received == frames * FRAME_SAMPLES * 2
    assert done_at_first_bytes is False
    assert len(handler.history) == finished_before + 1  # and then it did finish


async def test_whole_wav_response(client):
    r = await client.post("/v1/audio/speech", json=body(max_new_tokens=6, response_format="wav"))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        assert w.getnframes() == 6 * FRAME_SAMPLES


async def test_disconnect_mid_stream_frees_the_handler_within_one_chunk(server, client):
    handler = server.engine.active
    received = 0
    async with client.stream("POST", "/v1/audio/speech",
                             json=body(stream=True, response_format="pcm", max_new_tokens=400)) as r:  # fmt: skip
        async for data in r.aiter_raw():
            received += len(data)
            break  # first audio arrived: hang up
    t_close = time.monotonic()
    while handler.in_flight and time.monotonic() - t_close < 60:
        await asyncio.sleep(0.01)
    assert handler.in_flight == 0
    stats = handler.last_stats
    assert stats["cancelled"]
    # Flow control: beyond the chunks the client got (whole or in part), the worker made at most
    # the one it may make ahead and the one it was working on when the client left.
    chunk_bytes = 4 * FRAME_SAMPLES * 2
    assert stats["frames"] <= 4 * (math.ceil(received / chunk_bytes) + 2), (received, stats)
    # The next request is served normally.
    r = await client.post("/v1/audio/speech", json=body(max_new_tokens=4, response_format="pcm"))
    assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2


async def test_a_paused_consumer_pauses_synthesis(server):
    """Flow control: while the consumer holds the first chunk, the worker makes one more (it
    stays one chunk ahead) and then nothing.

    Once the second chunk has arrived (unread), a memory query is answered by the worker
    between two steps, or at once while its only stream is paused; after its answer, closing
    the stream leaves exactly the 8 frames made (a worker that went on would be on frame 9 or
    later by then)."""
    handler = server.engine.active
    req = parse_speech_request(
        body(stream=True, response_format="pcm", max_new_tokens=400), Limits()
    )
    chunks = server.engine.stream(req)
    first = await anext(chunks)
    assert first.frames == 4
    (unread,) = handler._streams.values()
    for _ in range(6000):
        if unread.qsize():
            break
        await asyncio.sleep(0.01)
    assert unread.qsize() == 1  # the second chunk, made while the consumer held the first
    answered = handler.memory_reports
    handler._conn.send(QueryMemory())
    for _ in range(6000):
        if handler.memory_reports > answered:
            break
        await asyncio.sleep(0.01)
    assert handler.memory_reports > answered
    await chunks.aclose()
    assert handler.in_flight == 0
    assert handler.last_stats["cancelled"] and handler.last_stats["frames"] == 8, handler.last_stats


async def test_killed_worker_gives_an_error_then_recovers(server, client):
    handler = server.engine.active
    pid = handler.pid
    with pytest.raises(httpx.HTTPError):
        async with client.stream("POST", "/v1/audio/speech",
                                 json=body(stream=True, response_format="pcm", max_new_tokens=400)) as r:  # fmt: skip
            async for _ in r.aiter_raw():
                os.kill(pid, signal.SIGKILL)
    # The next request waits for the restarted worker and succeeds.
    r = await client.post("/v1/audio/speech", json=body(max_new_tokens=4, response_format="pcm"))
    assert r.status_code == 200 and len(r.content) == 4 * FRAME_SAMPLES * 2
    assert handler.pid != pid and handler.restarts >= 1


HOSTILE = [
    ("not json", b"{nope", None),
    ("json array", b"[1,2]", None),
    ("empty input", None, {"input": ""}),
    ("missing input", None, {"voice": "ryan"}),
    ("input wrong type", None, {"input": 42}),
    ("huge input", None, {"input": "a" * 5000}),
    ("body too large", b'{"input": "' + b"a" * 300_000 + b'"}', None),
    ("unknown voice", None, body(voice="darth")),
    ("unknown variant", None, body(variant="2bit")),
    ("variant not loaded", None, body(variant="4bit")),
    ("unknown language", None, body(language="elvish")),
    ("bad format", None, body(response_format="ogg")),
    ("stream not bool", None, body(stream="true")),
    ("negative tokens", None, body(max_new_tokens=-5)),
    ("tokens too many", None, body(max_new_tokens=10**9)),
    ("temperature type", None, body(temperature=[1])),
    ("top_p range", None, body(top_p=7)),
    ("bad task type", None, body(task_type="Clone")),
    ("wrong task type", None, body(task_type="VoiceDesign")),
    ("path traversal", None, body(ref_audio="../../etc/passwd")),
    ("absolute path", None, body(ref_audio="/etc/passwd.wav")),
    ("url ref", None, body(ref_audio="http://127.0.0.1:1/x.wav")),
    ("ref not audio", None, body(ref_audio="aGVsbG8gd29ybGQ=")),
    ("ref_text alone", None, body(ref_text="hi")),
    ("unknown model", None, body(model="gpt-4o-mini-tts-x")),
    ("speed", None, body(speed=3)),
    ("first chunk frames", None, body(first_chunk_frames=9)),
]


@pytest.mark.parametrize(("name", "raw", "payload"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_bad_requests_get_4xx_and_server_stays_ready(client, name, raw, payload):
    if raw is not None:
        r = await client.post("/v1/audio/speech", content=raw,
                              headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    else:
        r = await client.post("/v1/audio/speech", json=payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]["message"]
    assert (await client.get("/ready")).status_code == 200


async def test_auth_is_required(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        assert (await c.post("/v1/audio/speech", json=body())).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert (await c.post("/v1/audio/speech", json=body(), headers=bad)).status_code == 401
        assert (await c.get("/health")).status_code == 200


async def test_full_queue_answers_429_with_retry_after(server, client):
    handler = server.engine.active
    long = body(stream=False, response_format="pcm", max_new_tokens=24)
    n = handler.max_batch + handler.max_queue  # a full batch and a full queue

    def post():
        return asyncio.create_task(client.post("/v1/audio/speech", json=long, timeout=300))

    tasks = [post() for _ in range(n)]
    for _ in range(6000):
        if handler.queue_depth == n or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    extra = [post() for _ in range(2)]
    statuses = sorted(r.status_code for r in await asyncio.gather(*tasks, *extra))
    assert statuses.count(200) >= n and 429 in statuses
    rejected = [r for r in [t.result() for t in (*tasks, *extra)] if r.status_code == 429]
    assert rejected[0].headers["Retry-After"]


async def test_metrics_exposes_latency_and_memory(client):
    text = (await client.get("/metrics")).text
    for name in ("qwen3_tts_first_audio_seconds_count", "qwen3_tts_chunk_compute_seconds",
                 "qwen3_tts_queue_wait_seconds", "qwen3_tts_requests_total",
                 "qwen3_tts_active_variant", 'qwen3_tts_worker_memory_bytes{kind="rss"'):  # fmt: skip
        assert name in text, name
