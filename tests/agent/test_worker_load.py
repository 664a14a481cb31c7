"""The load a worker reports to LiveKit: CPU and its TTS fleet (every engine's free slots, queue
and memory pressure: voice_agent.fleet_load)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import httpx
import pytest

from qwen3_tts_engine.governor.policy import Policy
from tests.support.engine_process import EngineProcess, free_port
from voice_agent.fleet_load import FleetPoller, engine_load, fleet_load


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
    assert engine_load(
        _status(0, pressure=0.6, upgrade_at=0.4, critical_at=0.8), 4
    ) == pytest.approx(0.5)
    # the larger of queue and memory
    assert engine_load(_status(3, pressure=0.80), 4) == 0.75


class _Clock:
    """The fleet poller module's `time`, with a monotonic clock the test moves (staleness is a duration:
    read on a clock the test sets, it does not depend on how fast this machine runs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_poller_without_an_engine_goes_stale(monkeypatch):
    import voice_agent.fleet_load as fleet

    clock = _Clock()
    monkeypatch.setattr(fleet, "time", clock)
    poller = FleetPoller([f"http://127.0.0.1:{free_port()}"], interval=0.05, timeout=0.5).start()
    try:
        assert not poller.stale and poller.load(4) == 0.0  # just started: nothing heard yet
        clock.now += fleet.STALE_AFTER_S
        assert not poller.stale  # not yet: stale is *longer* than STALE_AFTER_S without an answer
        clock.now += 0.001
        assert poller.statuses == {} and poller.stale
        assert poller.load(4) == 1.0  # a silent fleet: saturated, whatever the CPU
    finally:
        poller.stop()


@pytest.mark.slow  # a real engine
def test_poller_reads_a_real_engine(tiny_checkpoint):
    """The status of a real engine, with one synthesis queued behind another. Each wait is for
    an event (the poller's first status; the poller seeing the three requests), bounded by a
    hang guard; the requests are long enough to be in flight until the poller has seen them,
    and then cancelled."""
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor").start()
    poller = FleetPoller(
        [engine.url], interval=0.1, timeout=60
    ).start()  # a busy host's slow answer is fine

    def status() -> dict | None:
        return poller.statuses.get(engine.url.rstrip("/"))

    try:
        deadline = time.monotonic() + 120  # a hang guard
        while status() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status() is not None and not poller.stale, "no status from the engine"
        # --no-governor: no automatic swaps, but the governor still reads the host's memory
        assert 0.0 <= status()["governor"]["pressure"]["pressure"]
        assert engine_load({**status(), "governor": None}, 4) == 0.0  # an idle queue

        async def busy() -> float:
            """Three long requests at once; the load the poller saw once all three were queued."""
            body = {"input": "Hello there, this keeps the engine busy. " * 4,
                    "voice": "ryan", "max_new_tokens": 400, "stream": True,
                    "response_format": "pcm"}  # fmt: skip

            async def one(client: httpx.AsyncClient) -> None:
                async with client.stream("POST", f"{engine.url}/v1/audio/speech", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass

            async with httpx.AsyncClient(timeout=300) as client:
                tasks = [asyncio.ensure_future(one(client)) for _ in range(3)]
                try:
                    async with asyncio.timeout(120):  # a hang guard
                        while (seen := engine_load({**status(), "governor": None}, 4)) < 0.75:
                            assert not any(t.done() for t in tasks), [
                                t.result() for t in tasks if t.done()
                            ]
                            await asyncio.sleep(0.05)
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            return seen

        seen = asyncio.run(busy())
        assert seen == 0.75, f"the poller saw load {seen} with three requests in the engine"
    finally:
        poller.stop()
        engine.stop()


# -- the fleet (issue 35): free slots of every engine behind TTS_URL ------------------------------


def _with_capacity(free: int, slots: int, pressure: float | None = None) -> dict:
    return {**_status(slots - free, pressure=pressure),
            "capacity": {"free_slots": free, "slots": slots}}  # fmt: skip


def test_fleet_load_is_the_share_of_slots_taken_over_all_engines():
    assert fleet_load([_with_capacity(2, 2), _with_capacity(4, 4)], 4) == 0.0
    assert fleet_load([_with_capacity(0, 2), _with_capacity(1, 4)], 4) == pytest.approx(1 - 1 / 6)
    assert fleet_load([_with_capacity(0, 2), _with_capacity(0, 4)], 4) == 1.0  # all full: full
    # an engine at its critical memory mark has no room whatever its slots say
    assert fleet_load([_with_capacity(0, 2), _with_capacity(4, 4, pressure=0.99)], 4) == 1.0
    # TTS_QUEUE_CAPACITY requests on every engine: full, whatever the slots
    assert fleet_load([_with_capacity(4, 8)], 4) == 1.0
    # engines without a capacity report: the least loaded one by its queue
    assert fleet_load([_status(4), _status(1)], 4) == 0.25
    assert fleet_load([None, None], 4) == 0.0


async def _engine(model: str, host: str, port: int, max_batch: int):
    from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig

    srv = EngineServer(Engine(model, [Handler(model, max_batch=max_batch, frame_budget_s=None)]),
                       ServerConfig(host=host, port=port))  # fmt: skip
    await srv.start()
    return srv


@pytest.mark.slow  # two real engines on loopback
async def test_a_worker_whose_engines_are_full_reports_itself_full(tiny_checkpoint):
    """One TTS_URL name resolving to two engines (1 and 2 slots): the fleet poller's load goes
    0 -> 1/3 -> 2/3 -> 1.0 as streams fill them (by the engines' own /load), and back to 0."""
    model = str(tiny_checkpoint("custom_voice", eos="never"))  # utterances that never end early
    port = free_port()
    engines = [await _engine(model, f"127.0.0.{i + 1}", port, n) for i, n in enumerate((1, 2))]
    poller = FleetPoller([f"http://tts-fleet.test:{port}"], interval=0.05, timeout=30,
                         resolve=lambda host, p: ["127.0.0.1", "127.0.0.2"]).start()  # fmt: skip
    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30))
    body = {"input": "Hold this line for a while.", "voice": "ryan", "language": "english",
            "stream": True, "response_format": "pcm", "max_new_tokens": 2000}  # fmt: skip
    held: list[httpx.Response] = []

    async def load_once_running(n: int) -> float:
        """The poller's load from a round that began after the engines ran `n` streams."""
        async with asyncio.timeout(120):
            while sum([(await client.get(f"http://{e.config.host}:{port}/load")).json()["running"]
                       for e in engines]) != n:  # fmt: skip
                await asyncio.sleep(0.05)
            after = poller.rounds + 1  # the round in flight may have begun before
            while poller.rounds <= after:
                await asyncio.sleep(0.05)
        return poller.load(4)

    try:
        assert await load_once_running(0) == 0.0
        assert sorted(poller.statuses) == [f"http://127.0.0.{i}:{port}" for i in (1, 2)]
        for n, expected in ((1, 1 / 3), (2, 2 / 3), (3, 1.0)):
            url = f"http://{engines[0 if n == 1 else 1].config.host}:{port}/v1/audio/speech"
            held.append(await client.send(client.build_request("POST", url, json=body), stream=True))  # fmt: skip
            assert held[-1].status_code == 200
            assert await load_once_running(n) == pytest.approx(expected)
        assert not poller.stale
        for r in held:
            await r.aclose()
        assert await load_once_running(0) == 0.0
    finally:
        for r in held:
            await r.aclose()
        await client.aclose()
        poller.stop()
        for e in engines:
            await e.stop()


def test_load_fnc_polls_every_engine_in_tts_url(monkeypatch):
    """The worker's load_fnc watches the whole TTS_URL list, not only its first URL."""
    import voice_agent.worker as worker

    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.2:{free_port()}/"]
    monkeypatch.setenv("TTS_URL", ",".join(urls))
    monkeypatch.setenv("AGENT_LOAD_CPU", "0")
    monkeypatch.setattr(worker, "_poller", None)
    try:
        assert worker.load(None) == 0.0  # nothing heard yet, not yet stale
        assert worker._poller.urls == [u.rstrip("/") for u in urls]
    finally:
        worker._poller.stop()
