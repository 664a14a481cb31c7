"""What an engine reports of its load, and how it admits by real-time headroom (docs/fleet.md).

Real engine servers on loopback on the tiny checkpoint whose utterances run to `max_new_tokens`
(eos "never": frame counts are exact). Streams are held running by not reading them: after two
untaken chunks the worker pauses a stream, which stays admitted until the client lets go.

The real-time admission is tested without depending on this machine's speed: the engine's
fault-injection setting makes every batch step sleep 100 ms per stream in it, longer than the
80 ms frame budget on its own, so the engine's own measured steps exceed the budget at any size
and its slots are 1 whatever the CPU does; and every chunk after a stream's first comes later than
a listener needs it (4 frames take at least 400 ms to make, 320 ms to play), so the underrun count
follows from the chunk count.

The learning both ways is tested the same way: a budget of 2 s that the tiny checkpoint's own
steps fit easily (tens of ms a step, a vocoder step some hundreds), and a step delay of 3 s per
stream switched on and off over the operator API while streams run: a step slowed by it takes at
least 3 s per stream (a lower bound, whatever the machine's speed), over the budget at any size.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import httpx
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.protocol import ENGINE_FULL, LoadReport

HANG_GUARD_S = 120.0


def _body(frames: int = 400, **kw) -> dict:
    return {"input": "Hold this line for a while.", "voice": "ryan", "language": "english",
            "stream": True, "response_format": "pcm", "seed": 1, "max_new_tokens": frames, **kw}  # fmt: skip


async def _start(engine_kw: dict, tiny_checkpoint, **server_kw) -> EngineServer:
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    srv = EngineServer(
        Engine(model, [Handler(model, **engine_kw)]), ServerConfig(port=0, **server_kw)
    )
    await srv.start()
    return srv


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    """Two slots by configuration (no frame budget), one place in the queue."""
    srv = await _start({"max_batch": 2, "max_queue": 1, "frame_budget_s": None}, tiny_checkpoint)
    yield srv
    await srv.stop()


@pytest.fixture(scope="module")
async def slow_server(tiny_checkpoint):
    """Three batch rows, an 80 ms frame budget, and steps slowed by 100 ms per stream."""
    srv = await _start({"max_batch": 3, "max_queue": 1, "frame_budget_s": 0.080, "step_delay_s": 0.100},
                       tiny_checkpoint)  # fmt: skip
    yield srv
    await srv.stop()


@pytest.fixture(scope="module")
async def learning_server(tiny_checkpoint):
    """Two batch rows, a 2 s frame budget, no fault at first; a probe after 2 s of waiting."""
    srv = await _start({"max_batch": 2, "max_queue": 4, "frame_budget_s": 2.0, "probe_every_s": 2.0},
                       tiny_checkpoint, allow_fault_injection=True)  # fmt: skip
    yield srv
    await srv.stop()


class Held:
    """A streaming request that has had its first audio and is then not read (it stays admitted
    until `release`)."""

    def __init__(self, client: httpx.AsyncClient, body: dict) -> None:
        self.client, self.body = client, body
        self.stack = contextlib.AsyncExitStack()
        self.status: int | None = None
        self.chunks = None

    async def start(self) -> Held:
        r = await self.stack.enter_async_context(
            self.client.stream("POST", "/v1/audio/speech", json=self.body)
        )
        self.status = r.status_code
        if r.status_code == 200:
            self.chunks = r.aiter_raw()  # kept: a collected iterator would close the response
            await anext(self.chunks)
        return self

    async def release(self) -> None:
        await self.stack.aclose()


async def _load(client: httpx.AsyncClient) -> LoadReport:
    r = await client.get("/load")
    assert r.status_code == 200, r.text
    return LoadReport.from_json(r.json())


async def _until_load(client: httpx.AsyncClient, what: str, ok) -> LoadReport:
    """Poll /load until `ok(load)` (the event), bounded by the hang guard."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not ok(load := await _load(client)):
            await asyncio.sleep(0.02)
    assert ok(load), what
    return load


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def _scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "qwen3_tts_slots", "qwen3_tts_free_slots"):  # fmt: skip
        assert f"# TYPE {name} gauge" in r.text, name  # llm-d reads an untyped metric as 0
    return r.text


async def test_load_and_gauges_move_with_load_and_a_full_engine_answers_429(server):
    base = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as client:
        idle = await _load(client)
        assert (idle.running, idle.waiting, idle.slots, idle.free_slots) == (0, 0, 2, 2)
        assert (idle.state, idle.accepting, idle.max_batch, idle.frame_budget_ms) == (
            "serving",
            True,
            2,
            None,
        )
        text = await _scrape(client)
        assert (
            _metric(text, "vllm:num_requests_running") == 0
            and _metric(text, "vllm:kv_cache_usage_perc") == 0
        )
        assert _metric(text, "qwen3_tts_free_slots") == 2

        first = await Held(client, _body()).start()
        one = await _load(client)
        assert (one.running, one.waiting, one.free_slots) == (1, 0, 1)
        second = await Held(client, _body()).start()
        full = await _load(client)
        assert (full.running, full.waiting, full.free_slots) == (2, 0, 0)
        text = await _scrape(client)
        assert (
            _metric(text, "vllm:num_requests_running") == 2
            and _metric(text, "vllm:kv_cache_usage_perc") == 1
        )
        assert _metric(text, "qwen3_tts_requests_running") == 2

        queued = asyncio.create_task(Held(client, _body()).start())  # waits for a slot
        waiting = await _until_load(client, "a request queued", lambda lo: lo.waiting == 1)
        assert (waiting.running, waiting.free_slots) == (2, 0)
        assert _metric(await _scrape(client), "vllm:num_requests_waiting") == 1
        status = (await client.get("/v1/engine/status")).json()
        assert {k: status["capacity"][k] for k in ("running", "waiting", "slots")} == {
            "running": 2,
            "waiting": 1,
            "slots": 2,
        }

        # The batch and the queue are full: the next one is turned away at once, never queued.
        r = await client.post("/v1/audio/speech", json=_body())
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == ENGINE_FULL
        assert (await _load(client)).waiting == 1

        await first.release()  # its slot goes to the queued request
        third = await queued
        assert third.status == 200
        await _until_load(
            client, "the queue emptied", lambda lo: (lo.running, lo.waiting) == (2, 0)
        )
        await second.release()
        await third.release()
        done = await _until_load(client, "all streams ended", lambda lo: lo.running == 0)
        assert done.free_slots == 2
        assert _metric(await _scrape(client), "vllm:num_requests_running") == 0


async def _speak(client: httpx.AsyncClient, frames: int) -> int:
    """A whole streamed utterance, read as it comes; returns its byte count."""
    n = 0
    async with client.stream("POST", "/v1/audio/speech", json=_body(frames)) as r:
        assert r.status_code == 200
        async for data in r.aiter_raw():
            n += len(data)
    return n


async def test_an_engine_slower_than_its_frame_budget_admits_fewer_streams(slow_server):
    handler = slow_server.engine.active
    base = f"http://127.0.0.1:{slow_server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as client:
        fresh = await _load(client)
        assert (fresh.slots, fresh.max_batch, fresh.frame_budget_ms) == (
            1,
            3,
            80.0,
        )  # nothing measured yet

        # One stream, read as it comes: 12 frames in three 4-frame chunks.
        await _speak(client, 12)
        stats = handler.last_stats
        assert stats["chunk_frames"] == [4, 4, 4]
        # every step took >= 100 ms per stream: each chunk after the first came after the 320 ms
        # its predecessor plays for (unless the client held it back: then playback restarts)
        assert stats["underruns"] + stats["resumed_chunks"] == 2, stats
        measured = await _until_load(
            client, "its steps reported", lambda lo: lo.underruns == stats["underruns"]
        )
        assert "1" in measured.step_s and measured.step_s["1"] >= 0.100
        # a second stream is predicted at >= 2 x 100 ms a step: over the budget
        assert measured.step_s["2"] >= 0.200 and measured.slots == 1
        text = await _scrape(client)
        assert _metric(text, "qwen3_tts_slots") == 1
        assert _metric(text, "qwen3_tts_underruns_total") == stats["underruns"]
        assert 'qwen3_tts_batch_step_seconds_count{streams="1"' in text or re.search(
            r'qwen3_tts_batch_step_seconds_count\{[^}]*streams="1"', text
        )

        # With one slot, a second request waits although two more batch rows are configured,
        # and a third is turned away.
        first = await Held(client, _body()).start()
        queued = asyncio.create_task(Held(client, _body()).start())
        waiting = await _until_load(client, "a request queued", lambda lo: lo.waiting == 1)
        assert (waiting.running, waiting.slots, waiting.free_slots) == (1, 1, 0)
        r = await client.post("/v1/audio/speech", json=_body())
        assert r.status_code == 429 and r.json()["error"]["code"] == ENGINE_FULL
        await first.release()
        second = await queued
        await second.release()
        await _until_load(client, "all streams ended", lambda lo: lo.running == 0)
    # no step ever ran two streams: the worker's own record
    assert all(s["peak_batch"] <= 1 for s in handler.history), [
        s["peak_batch"] for s in handler.history
    ]


class Reading:
    """A streaming request read as it comes (so its stream steps in every batch) until `release`."""

    def __init__(self, client: httpx.AsyncClient, body: dict) -> None:
        self.client, self.body = client, body
        self.first = asyncio.Event()
        self.status: int | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with self.client.stream("POST", "/v1/audio/speech", json=self.body) as r:
            self.status = r.status_code
            async for _ in r.aiter_raw():
                self.first.set()

    async def release(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _fault(client: httpx.AsyncClient, step_delay_ms: float) -> None:
    r = await client.post("/v1/engine/fault", json={"step_delay_ms": step_delay_ms})
    assert r.status_code == 200, r.text
    assert r.json()["step_delay_ms"] == step_delay_ms


async def test_slots_learn_from_the_engines_own_steps_both_ways(learning_server):
    """Slots grow from cheap measured steps, fall when the step delay is switched on over the
    operator API while streams run, and come back once it is off: the probe admits a waiting
    stream over the one slot, its steps measure two streams again, and two fit."""
    handler = learning_server.engine.active
    base = f"http://127.0.0.1:{learning_server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as client:
        r = await client.post("/v1/engine/fault", json={"step_delay_ms": "slow"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "step_delay_ms"
        assert (await _load(client)).slots == 1  # nothing measured yet
        await _speak(client, 12)  # one stream: its steps fit the budget many times over
        await _until_load(client, "one stream's steps show room for two", lambda lo: lo.slots == 2)
        assert 2 not in handler.steps.measured()  # two streams: predicted from one, not measured

        first = second = third = None
        try:
            first = Reading(client, _body(1500))
            async with asyncio.timeout(HANG_GUARD_S):
                await first.first.wait()
            await _fault(client, 3000)  # from the worker's next step: >= 3 s per stream a step
            second = Reading(client, _body(1500))  # admitted: 2 slots
            await _until_load(client, "the second stream admitted", lambda lo: lo.running == 2)
            await _until_load(client, "two slowed streams measured", lambda lo: lo.slots == 1)
            assert handler.steps.measured()[2] >= 6.0  # every step of two streams slept 2 x 3 s

            # One slot: a third request waits (two run, over the slots)
            third = Reading(client, _body(1500))
            waiting = await _until_load(
                client, "the third request queued", lambda lo: lo.waiting == 1
            )
            assert (waiting.running, waiting.slots) == (2, 1), waiting
            await _fault(client, 0)
            await second.release()
            # the first runs alone, at the one slot; the third has waited past the probe interval,
            # so a step report admits it, and two fast streams' steps bring the slots back to 2
            await _until_load(client, "the slots came back",
                              lambda lo: (lo.running, lo.waiting, lo.slots) == (2, 0, 2))  # fmt: skip
            assert handler.probes >= 1  # the slots could not grow before two streams ran again
            async with asyncio.timeout(HANG_GUARD_S):
                await third.first.wait()
            assert (first.status, third.status) == (200, 200)
        finally:
            for reading in (first, second, third):
                if reading is not None:
                    await reading.release()
        await _until_load(client, "all streams ended", lambda lo: lo.running == 0)
