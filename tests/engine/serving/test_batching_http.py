"""Continuous batching over HTTP: concurrent streams on one handler sound as each does alone.

A real engine server on loopback with one handler whose worker batches up to 4 streams; a tiny
checkpoint whose utterances end by EOS after about one frame per text token (so the streams
end at different frames). Each stream's PCM is compared with the same request served alone.
"""

import asyncio

import httpx
import numpy as np
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.protocol import FRAME_SAMPLES

BODIES = {
    "a": {"input": "Hello there, how are you?", "seed": 1},
    "b": {
        "input": "A longer one that goes on for a while.",
        "seed": 2,
        "temperature": 0.7,
        "top_k": 20,
    },
    "c": {
        "input": "Short.",
        "seed": 3,
        "top_p": 0.8,
        "repetition_penalty": 1.3,
        "first_chunk_frames": 1,
    },
    "d": {
        "input": "One two three four five.",
        "seed": 4,
        "temperature": 0.0,
        "first_chunk_frames": 2,
    },
}


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    srv = EngineServer(Engine(model, [Handler(model, max_batch=4)]), ServerConfig(port=0))
    await srv.start()
    yield srv
    await srv.stop()


async def _speak(client: httpx.AsyncClient, name: str, started: asyncio.Event | None = None,
                 hang_up: bool = False) -> bytes:  # fmt: skip
    body = {"voice": "ryan", "language": "english", "stream": True, "response_format": "pcm",
            **BODIES.get(name, {"input": "A very long answer that the caller interrupts. " * 4, "seed": 9})}  # fmt: skip
    pcm = bytearray()
    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for data in r.aiter_raw():
            pcm += data
            if started is not None:
                started.set()
            if hang_up and len(pcm) >= 4 * FRAME_SAMPLES * 2:
                break
    return bytes(pcm)


def _samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, np.int16).astype(np.int32)


async def test_concurrent_streams_equal_their_solo_runs(server):
    handler = server.engine.active
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as client:
        alone = {name: await _speak(client, name) for name in BODIES}
        lengths = {name: len(pcm) // (FRAME_SAMPLES * 2) for name, pcm in alone.items()}
        assert len(set(lengths.values())) == len(lengths), lengths  # EOS at different frames
        history_before = len(handler.history)

        a_started = asyncio.Event()
        first = [asyncio.create_task(_speak(client, "a", a_started)),
                 asyncio.create_task(_speak(client, "b")),
                 asyncio.create_task(_speak(client, "interrupted", hang_up=True))]  # fmt: skip
        await a_started.wait()
        late = [asyncio.create_task(_speak(client, n)) for n in ("c", "d")]  # join mid-flight
        a, b, interrupted, c, d = await asyncio.gather(*first, *late)

    for name, pcm in zip("abcd", (a, b, c, d), strict=True):
        assert len(pcm) == len(alone[name]), name
        assert np.abs(_samples(pcm) - _samples(alone[name])).max() <= 1, name  # one LSB at most
    assert 0 < len(interrupted) < lengths["b"] * FRAME_SAMPLES * 2
    stats = list(handler.history)[history_before:]
    assert len(stats) == 5 and sum(s["cancelled"] for s in stats) == 1
    assert max(s["peak_batch"] for s in stats) >= 3  # they did run together
    for s in stats:  # 4-frame chunks, the first as requested, only the last shorter
        frames = s["chunk_frames"]
        assert all(f == 4 for f in frames[1:-1]) and frames[0] in (1, 2, 4) and frames[-1] <= 4
