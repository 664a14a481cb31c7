"""The load a worker reports to LiveKit: CPU, the TTS engine's queue and its memory pressure."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import httpx
import pytest

from qwen3_tts_engine.governor.policy import Policy
from tests.support.engine_process import EngineProcess, free_port
from voice_agent.worker import EnginePoller, engine_load, worker_load


def _status(*depths: int, pressure: float | None = None, **policy) -> dict:
    """A status body as the engine sends it: with a governor, its whole policy is there."""
    handlers = [{"name": f"h{i}", "queue_depth": d} for i, d in enumerate(depths)]
    governor = None
    if pressure is not None:
        governor = {"pressure": {"source": "manual", "pressure": pressure},
                    "policy": {**asdict(Policy()), **policy}}  # fmt: skip
    return {"handlers": handlers, "governor": governor}


def test_queue_depth_over_capacity():
    assert engine_load(_status(0), 4) == 0.0
    assert engine_load(_status(1), 4) == 0.25
    assert engine_load(_status(3), 4) == 0.75  # >= 0.7, LiveKit's production threshold: full
    assert engine_load(_status(9), 4) == 1.0  # capped
    assert engine_load(_status(1, 1), 4) == 0.5  # a retiring handler's requests count too
    assert engine_load(_status(2), 0) == 1.0  # capacity 0 is treated as 1


def test_no_status_adds_nothing():
    assert engine_load(None, 4) == 0.0
    assert engine_load({}, 4) == 0.0
    assert engine_load({"handlers": [{"queue_depth": None}], "governor": None}, 4) == 0.0


def test_memory_pressure_between_the_governors_watermarks():
    assert engine_load(_status(0, pressure=0.5), 4) == 0.0  # below upgrade_at (0.65)
    assert engine_load(_status(0, pressure=0.65), 4) == 0.0
    assert engine_load(_status(0, pressure=0.80), 4) == pytest.approx(0.5)
    assert engine_load(_status(0, pressure=0.86), 4) == pytest.approx(0.7)  # ~ downgrade_at
    assert engine_load(_status(0, pressure=0.95), 4) == 1.0  # critical_at
    assert engine_load(_status(0, pressure=1.2), 4) == 1.0
    # the engine's own policy decides where the band lies
    assert engine_load(_status(0, pressure=0.6, upgrade_at=0.4, critical_at=0.8), 4) == pytest.approx(0.5)
    # the larger of queue and memory
    assert engine_load(_status(3, pressure=0.80), 4) == 0.75


def test_worker_load_is_the_busier_of_cpu_and_engine():
    assert worker_load(0.2, _status(0), 4) == 0.2
    assert worker_load(0.2, _status(2), 4) == 0.5
    assert worker_load(0.9, _status(2), 4) == 0.9
    assert worker_load(1.5, None, 4) == 1.0
    assert worker_load(0.1, _status(0), 4, stale=True) == 1.0  # a silent engine: saturated


def test_poller_without_an_engine_goes_stale(monkeypatch):
    monkeypatch.setattr("voice_agent.worker.STALE_AFTER_S", 0.2)
    poller = EnginePoller(f"http://127.0.0.1:{free_port()}", interval=0.05, timeout=0.5).start()
    try:
        assert not poller.stale
        time.sleep(0.5)
        assert poller.status is None and poller.stale
    finally:
        poller.stop()


@pytest.mark.slow  # a real engine: ~45 s on 2 shared cores
def test_poller_reads_a_real_engine(tiny_checkpoint):
    """The status of a real engine, with one synthesis queued behind another."""
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor").start()
    poller = EnginePoller(engine.url, interval=0.1).start()
    try:
        deadline = time.monotonic() + 10
        while poller.status is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert poller.status is not None and not poller.stale, "no status from the engine"
        # --no-governor: no automatic swaps, but the governor still reads the host's memory
        assert 0.0 <= poller.status["governor"]["pressure"]["pressure"]
        assert engine_load({**poller.status, "governor": None}, 4) == 0.0  # an idle queue

        async def busy() -> float:
            """Three requests at once; the highest load the poller saw while they ran."""
            body = {"input": "Hello there, this keeps the engine busy.",
                    "voice": "ryan", "max_new_tokens": 12, "stream": True,
                    "response_format": "pcm"}  # fmt: skip
            seen = 0.0

            async def one(client: httpx.AsyncClient) -> None:
                async with client.stream("POST", f"{engine.url}/v1/audio/speech", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass

            async with httpx.AsyncClient(timeout=120) as client:  # the third waits for two
                tasks = [asyncio.ensure_future(one(client)) for _ in range(3)]
                while not all(t.done() for t in tasks):
                    seen = max(seen, engine_load({**poller.status, "governor": None}, 4))
                    await asyncio.sleep(0.05)
                for t in tasks:
                    t.result()
            return seen

        seen = asyncio.run(busy())
        assert seen >= 0.25, f"the poller never saw the queue (max load {seen})"
    finally:
        poller.stop()
        engine.stop()
