"""The shapes routers already read, on a real engine server (tiny checkpoint, loopback):
`/load`'s `server_load` (vLLM's name), `GET /get_load` -> `{"load": N}` (vllm-router's
power_of_two), the load gauges under vLLM's and SGLang's names in a real `/metrics` scrape, all
without a key; and `/ready` 503 through a make-before-break swap, 200 once the new variant serves
(docs/fleet.md). Streams are held admitted by not reading them (the worker pauses a stream after
two untaken chunks); every wait is for an event, bounded by a hang guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import httpx
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.dispatch.engine import MemoryBand, free_slots
from qwen3_tts_engine.governor.governor import Governor
from qwen3_tts_engine.governor.memory import ManualProbe
from qwen3_tts_engine.governor.policy import MAKE_BEFORE_BREAK, Policy

HANG_GUARD_S = 120.0
KEY = "router-shapes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GB = 1 << 30
# the load gauges, ours and the names routers read for the same quantity
GAUGES = {
    "running": ("qwen3_tts_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("qwen3_tts_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "usage": ("vllm:kv_cache_usage_perc", "sglang:token_usage"),
}  # fmt: skip


def _body(frames: int = 400) -> dict:
    return {"input": "Hold this line for a while.", "voice": "ryan", "language": "english",
            "stream": True, "response_format": "pcm", "seed": 1, "max_new_tokens": frames}  # fmt: skip


def test_free_and_full_in_one_rule():
    """`dispatch.engine.free_slots`: slots less streams, and none unless serving below the
    governor's critical memory mark (the memory band: 0 at upgrade_at, 1 at critical_at)."""
    assert free_slots("serving", 4, 1, 0.0) == 3
    assert free_slots("serving", 4, 6, 0.0) == 0  # overcommitted: full, never negative
    assert free_slots("serving", 4, 0, 1.0) == 0  # at the critical mark
    for state in ("swapping", "draining", "loading"):
        assert free_slots(state, 4, 0, 0.0) == 0
    band = [MemoryBand(p, upgrade_at=0.65, critical_at=0.95).load() for p in (0.5, 0.8, 0.95, 1.2)]
    assert band == pytest.approx([0.0, 0.5, 1.0, 1.0])


def _gauge(text: str, name: str) -> float:
    assert f"# TYPE {name} gauge" in text, f"{name} untyped or missing"  # llm-d reads untyped as 0
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} has no sample"
    return float(match.group(1))


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    """Two batch rows (no frame budget), queue of 2, an API key (the router shapes need none)."""
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    srv = EngineServer(Engine(model, [Handler(model, max_batch=2, max_queue=2, frame_budget_s=None)]),
                       ServerConfig(port=0, api_key=KEY))  # fmt: skip
    await srv.start()
    yield srv
    await srv.stop()


async def test_server_load_get_load_and_the_router_gauge_names(server):
    base = f"http://127.0.0.1:{server.port}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as public,
        contextlib.AsyncExitStack() as held,
    ):
        assert (await public.get("/v1/engine/status")).status_code == 401  # status needs the key

        async def shapes() -> tuple[dict, dict, str]:
            load, get_load, metrics = [
                await public.get(p) for p in ("/load", "/get_load", "/metrics")
            ]
            assert (load.status_code, get_load.status_code, metrics.status_code) == (200, 200, 200)
            return load.json(), get_load.json(), metrics.text

        load, get_load, text = await shapes()
        assert (load["server_load"], get_load) == (0, {"load": 0})
        for names in GAUGES.values():
            assert [_gauge(text, n) for n in names] == [0.0] * len(names)

        # two streams fill the batch (2 rows), a third waits for a slot
        chunks = []
        for _ in range(2):
            r = await held.enter_async_context(
                public.stream("POST", "/v1/audio/speech", json=_body(), headers=AUTH)
            )
            assert r.status_code == 200
            chunks.append(r.aiter_raw())  # kept: a collected iterator would close the response
            await anext(chunks[-1])  # audio: it runs; then it is held (not read)
        queued = asyncio.create_task(held.enter_async_context(
            public.stream("POST", "/v1/audio/speech", json=_body(), headers=AUTH)))  # fmt: skip
        async with asyncio.timeout(HANG_GUARD_S):
            while (await public.get("/load")).json()["waiting"] != 1:
                await asyncio.sleep(0.02)

        load, get_load, text = await shapes()
        assert (load["running"], load["waiting"], load["server_load"]) == (2, 1, 3)
        assert get_load == {"load": 3}  # running + waiting, as vLLM's server_load
        assert [_gauge(text, n) for n in GAUGES["running"]] == [2.0, 2.0, 2.0]
        assert [_gauge(text, n) for n in GAUGES["waiting"]] == [1.0, 1.0, 1.0]
        assert [_gauge(text, n) for n in GAUGES["usage"]] == [1.0, 1.0]  # running / slots
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued


async def test_ready_is_503_through_a_make_before_break_swap_then_200(tiny_checkpoint):
    """An operator swap with room for both workers (make before break): the old variant could
    serve throughout (`accepting` stays true), yet `/ready` answers 503 and `/load` says swapping,
    no free slot, while the new worker loads; 200 again once the new variant serves."""
    model = str(tiny_checkpoint("custom_voice"))
    probe = ManualProbe(limit_bytes=64 * GB, pressure=0.3)  # room for both workers
    policy = Policy(("bf16", "8bit"), cooldown_s=0.5)
    engine = Engine(model, [Handler(model, "bf16", max_batch=2)])
    governor = Governor(engine, probe, policy, interval_s=0.05, allow_unevaluated=("all",))
    srv = EngineServer(engine, ServerConfig(port=0, api_key=KEY), governor)
    await srv.start()
    base = f"http://127.0.0.1:{srv.port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300, connect=10)) as c:
            assert (await c.get("/ready")).status_code == 200
            swap = asyncio.create_task(c.post("/v1/engine/variant", headers=AUTH,
                                              json={"variant": "8bit", "mode": MAKE_BEFORE_BREAK}))  # fmt: skip
            async with asyncio.timeout(HANG_GUARD_S):  # the swap has begun: the new worker loads
                while governor.swapping is None:
                    assert not swap.done(), swap.result().text
                    await asyncio.sleep(0.01)
            ready, load = await c.get("/ready"), (await c.get("/load")).json()
            assert governor.swapping is not None, "the swap ended before it was observed"
            assert ready.status_code == 503 and ready.json()["swapping"], ready.text
            assert (load["state"], load["free_slots"], load["accepting"]) == ("swapping", 0, True)
            done = await swap
            assert done.status_code == 200 and done.json()["swap"]["mode"] == MAKE_BEFORE_BREAK
            ready = await c.get("/ready")
            assert ready.status_code == 200 and ready.json()["variant"] == "8bit", ready.text
    finally:
        await srv.stop()
