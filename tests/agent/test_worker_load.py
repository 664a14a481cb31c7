"""The load a worker reports to LiveKit: CPU and its TTS fleet (every engine's free slots, streams
and memory load from its public `GET /load`, weighed by the plugin's fleet contract:
voice_agent.fleet_load over `livekit.plugins.qwen3_tts.fleet`)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from livekit.plugins.qwen3_tts.fleet import Capacity, fleet_load
from qwen3_tts_engine.protocol import LoadReport
from tests.support.engine_process import EngineProcess, free_port
from voice_agent.fleet_load import FleetPoller
from voice_agent.settings import Settings


def _report(
    running: int = 0,
    waiting: int = 0,
    slots: int = 4,
    *,
    state: str = "serving",
    memory_load: float = 0.0,
) -> Capacity:
    """An engine's /load as the engine writes it (`protocol.LoadReport`), read by the plugin."""
    free = max(0, slots - running - waiting) if state == "serving" and memory_load < 1 else 0
    report = LoadReport(running=running, waiting=waiting, max_batch=8, slots=slots, free_slots=free,
                        accepting=state in ("serving", "swapping"), state=state, underruns=0,
                        server_load=running + waiting, memory_load=memory_load)  # fmt: skip
    load = Capacity.from_json(report.to_json())
    assert load is not None
    return load


def test_streams_over_the_queue_capacity_on_the_least_loaded_engine():
    one = [_report(slots=100, running=r) for r in (0, 1, 3, 9)]
    assert [fleet_load([lo], 4) for lo in one] == [0.0, 0.25, 0.75, 1.0]  # capped at 1
    assert fleet_load([_report(1, 1, slots=100)], 4) == 0.5  # waiting requests count too
    assert fleet_load([_report(2, slots=100)], 0) == 1.0  # capacity 0 is treated as 1
    assert fleet_load([_report(4, slots=100), _report(1, slots=100)], 4) == 0.25  # the least loaded
    assert fleet_load([_report(4, slots=100)]) == pytest.approx(0.04)  # no capacity: slots only


def test_no_report_adds_nothing():
    assert fleet_load([], 4) == 0.0
    assert Capacity.from_json({"server_load": 3}) is None  # vLLM's /load: not a report
    assert Capacity.from_json(None) is None


def test_memory_load_counts_and_at_the_critical_mark_the_engine_is_full():
    assert fleet_load([_report(slots=100, memory_load=0.5)], 4) == 0.5
    assert fleet_load([_report(3, slots=100, memory_load=0.5)], 4) == 0.75  # the larger
    # at the critical mark: no free slot, whatever its slots say
    assert fleet_load([_report(slots=4, memory_load=1.0)], 4) == 1.0
    assert fleet_load([_report(slots=4, memory_load=1.0), _report(slots=4)], 4) == 0.5


class _Clock:
    """The fleet poller module's `time`, with a monotonic clock the test moves (staleness is a duration:
    read on a clock the test sets, it does not depend on how fast this machine runs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_poller_without_an_engine_goes_stale(monkeypatch):
    import voice_agent.fleet_load as fleet_module

    clock = _Clock()
    monkeypatch.setattr(fleet_module, "time", clock)
    poller = FleetPoller([f"http://127.0.0.1:{free_port()}"], queue_capacity=4, interval=0.05,
                         timeout=0.5).start()  # fmt: skip
    try:
        assert not poller.stale and poller.load() == 0.0  # just started: nothing heard yet
        clock.now += fleet_module.STALE_AFTER_S
        assert not poller.stale  # not yet: stale is *longer* than STALE_AFTER_S without an answer
        clock.now += 0.001
        assert poller.loads == {} and poller.stale
        assert poller.load() == 1.0  # a silent fleet: saturated, whatever the CPU
    finally:
        poller.stop()


@pytest.mark.slow  # a real engine
def test_poller_reads_a_real_engine(tiny_checkpoint):
    """The public /load of a real engine (with an API key: /load needs none), with requests
    queued behind each other. Each wait is for an event (the poller's first report; the poller
    seeing the three requests), bounded by a hang guard; the requests are long enough to be in
    flight until the poller has seen them, and then cancelled."""
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor",
                           env={"QWEN3_TTS_API_KEY": "fleet-key"}).start()  # fmt: skip
    # a busy host's slow answer is fine
    poller = FleetPoller([engine.url], queue_capacity=4, interval=0.1, timeout=60).start()

    def load() -> Capacity | None:
        return poller.loads.get(engine.url.rstrip("/"))

    try:
        deadline = time.monotonic() + 120  # a hang guard
        while load() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert load() is not None and not poller.stale, "no load report from the engine"
        # --no-governor: no automatic swaps, but the governor still reads the host's memory
        assert load().memory_pressure is not None and load().server_load == 0

        async def busy() -> Capacity:
            """Three long requests at once; the report the poller had once all three were in."""
            body = {"input": "Hello there, this keeps the engine busy. " * 4,
                    "voice": "ryan", "max_new_tokens": 400, "stream": True,
                    "response_format": "pcm"}  # fmt: skip
            auth = {"Authorization": "Bearer fleet-key"}

            async def one(client: httpx.AsyncClient) -> None:
                async with client.stream("POST", f"{engine.url}/v1/audio/speech", json=body,
                                         headers=auth) as r:  # fmt: skip
                    async for _ in r.aiter_bytes():
                        pass

            async with httpx.AsyncClient(timeout=300) as client:
                tasks = [asyncio.ensure_future(one(client)) for _ in range(3)]
                try:
                    async with asyncio.timeout(120):  # a hang guard
                        while (seen := load()).server_load < 3:
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
        assert seen.server_load == seen.running + seen.waiting == 3, seen
        assert fleet_load([seen], 4) >= 0.75  # three of TTS_QUEUE_CAPACITY 4 at least
    finally:
        poller.stop()
        engine.stop()


# -- the fleet (issue 35): free slots of every engine behind TTS_URL ------------------------------


def test_fleet_load_is_the_share_of_slots_taken_over_all_engines():
    assert fleet_load([_report(slots=2), _report(slots=4)], 4) == 0.0
    assert fleet_load([_report(2, slots=2), _report(1, 2, slots=4)], 4) == pytest.approx(1 - 1 / 6)
    assert fleet_load([_report(2, slots=2), _report(4, slots=4)], 4) == 1.0  # all full: full
    # TTS_QUEUE_CAPACITY requests on every engine: full, whatever the slots
    assert fleet_load([_report(4, slots=8)], 4) == 1.0
    # an engine that swaps, drains or loads takes no new stream: none of its slots are free
    for state in ("swapping", "draining", "loading"):
        assert fleet_load([_report(slots=2), _report(slots=2, state=state)], 4) == 0.5, state


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
    poller = FleetPoller([f"http://tts-fleet.test:{port}"], queue_capacity=4, interval=0.05,
                         timeout=30, resolve=lambda host, p: ["127.0.0.1", "127.0.0.2"]).start()  # fmt: skip
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
        return poller.load()

    try:
        assert await load_once_running(0) == 0.0
        assert sorted(poller.loads) == [f"http://127.0.0.{i}:{port}" for i in (1, 2)]
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
    """The worker's load_fnc watches the whole TTS_URL list, not only its first URL, weighed
    with the settings it was given (no environment variable between them)."""
    import voice_agent.worker as worker

    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.2:{free_port()}/"]
    settings = Settings.load({"AGENT_LOAD_CPU": "0", "TTS_QUEUE_CAPACITY": "3"}, dotenv=None)
    monkeypatch.setattr(worker, "_poller", None)
    poller = worker.watch_fleet(settings, ",".join(urls))
    try:
        assert worker.load(None) == 0.0  # nothing heard yet, not yet stale; the CPU left out
        assert poller.urls == [u.rstrip("/") for u in urls] and poller.queue_capacity == 3
    finally:
        poller.stop()
        monkeypatch.setattr(worker, "_count_cpu", True)
