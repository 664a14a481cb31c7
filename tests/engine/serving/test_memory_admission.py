"""Memory in admission (dispatch/capacity.py `Admission`, models/stream_memory.py): a stream that
would push the worker's streams past its memory budget waits, beside the slot rule, and starts
when one ends.

The real engine: loopback, the tiny checkpoint whose utterances run to `max_new_tokens` (eos
"never"), no frame budget (slots = max_batch = 4, so any wait is memory's), and a memory budget
that holds exactly two streams' worth by the worker's own layout. Streams are held running by not
reading them (the worker pauses them after two untaken chunks); the order is shown by /load and
the responses, never by timing.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.dispatch.capacity import Admission
from tests.engine.serving.test_load import Held, _body, _load, _until_load

FRAMES = 400


async def test_admission_holds_what_does_not_fit_in_order_and_lets_one_alone_start():
    budget = 10
    gate = Admission(lambda: 4, fits=lambda costs: sum(costs) <= budget)
    order: list[str] = []

    async def take(name: str, cost: int) -> None:
        await gate.acquire(cost)
        order.append(name)

    await take("a", 6)
    b = asyncio.create_task(take("b", 6))  # 12 > 10: waits although a slot is free
    c = asyncio.create_task(take("c", 1))  # would fit, but comes after b (FIFO)
    await asyncio.sleep(0)
    assert order == ["a"] and gate.held_by_memory and gate.held == [6]
    gate.release(6)  # a ends: b fits, then c beside it
    await asyncio.gather(b, c)
    assert order == ["a", "b", "c"] and gate.held == [6, 1] and not gate.held_by_memory
    gate.release(6)
    gate.release(1)
    await take("huge", 50)  # alone over the budget: it starts (it would wait forever)
    d = asyncio.create_task(take("d", 1))
    await asyncio.sleep(0)
    assert "d" not in order and gate.held_by_memory
    d.cancel()  # a waiter that leaves frees the queue
    with pytest.raises(asyncio.CancelledError):
        await d
    assert not gate.held_by_memory and gate.running == 1
    gate.release(50)
    assert gate.running == 0 and gate.held == []


async def test_a_stream_past_the_memory_budget_waits_and_starts_when_one_ends(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    handler = Handler(model, max_batch=4, max_queue=4, frame_budget_s=None)
    server = EngineServer(Engine(model, [handler]), ServerConfig(port=0))
    await server.start()
    try:
        await _two_fit_and_the_third_waits(server, handler)
    finally:
        await server.stop()


async def _two_fit_and_the_third_waits(server: EngineServer, handler: Handler) -> None:
    layout = handler.stream_layout  # what its worker reported of the loaded model
    assert layout is not None and layout.talker_kv_per_frame > 0 and layout.chunk_transient > 0
    two = layout.batch_bytes([FRAMES] * 2)
    assert layout.batch_bytes([FRAMES] * 3) > two
    handler.stream_memory_bytes = two  # exactly two streams of FRAMES frames fit
    base = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as client:
        idle = await _load(client)
        assert (idle.stream_memory_bytes, idle.stream_memory_budget_bytes) == (0, two)
        assert idle.slots == 4 and not idle.waiting_for_memory
        first = await Held(client, _body(FRAMES)).start()
        second = await Held(client, _body(FRAMES)).start()
        full = await _load(client)
        assert (full.running, full.waiting, full.stream_memory_bytes) == (2, 0, two)

        third = asyncio.create_task(Held(client, _body(FRAMES)).start())
        held = await _until_load(client, "the third waits", lambda lo: lo.waiting == 1)
        assert held.running == 2 and held.slots == 4 and held.waiting_for_memory  # memory's wait
        assert not third.done()

        await first.release()  # its memory goes to the third
        started = await third
        assert started.status == 200  # it had its first audio
        after = await _until_load(
            client, "the third runs", lambda lo: (lo.running, lo.waiting) == (2, 0)
        )
        assert after.stream_memory_bytes == two and not after.waiting_for_memory
        await second.release()
        await started.release()
        done = await _until_load(client, "all ended", lambda lo: lo.running == 0)
        assert done.stream_memory_bytes == 0


def test_the_serve_flag_and_the_config():
    from qwen3_tts_engine.cli import build_parser, engine_config
    from qwen3_tts_engine.config import EngineConfig

    def parsed(*flags):
        return engine_config(build_parser().parse_args(["serve", *flags])).stream_memory

    assert parsed() == "auto" and parsed("--stream-memory-mb", "off") is None
    assert parsed("--stream-memory-mb", "1500") == 1_500_000_000
    for bad in ("lots", "0"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--stream-memory-mb", bad])
    with pytest.raises(ValueError, match="stream_memory"):
        EngineConfig("m", stream_memory="plenty")


async def test_auto_gives_the_streams_the_watermark_less_the_engine_as_loaded(tiny_checkpoint):
    """`stream_memory="auto"` with a governor: the worker may use its downgrade watermark of the
    probe's limit less the server and the spare; its streams get that less the worker's RSS when
    it became ready. Without a governor, no rule."""
    from qwen3_tts_engine.config import EngineConfig, GovernorConfig, build_server, worker_budget
    from qwen3_tts_engine.governor.memory import ManualProbe
    from qwen3_tts_engine.governor.policy import Policy
    from qwen3_tts_engine.models.memory_plan import SERVER_BYTES

    model = str(tiny_checkpoint("custom_voice", eos="never"))
    limit = 4 * 10**9
    policy = Policy(ladder=("bf16",))
    governor = GovernorConfig(policy, probe=ManualProbe(limit_bytes=limit, pressure=0.1),
                              auto=False)  # fmt: skip
    srv = build_server(EngineConfig(model, variants=["bf16"], frame_budget_s=None,
                                    server=ServerConfig(port=0), governor=governor))  # fmt: skip
    handler = srv.engine.active
    worker = worker_budget(limit, policy, spare_worker=False)
    assert handler.worker_memory_bytes == worker == int(0.85 * limit) - SERVER_BYTES
    assert handler.memory_budget is None  # not ready: its RSS is not known yet
    await srv.start()
    try:
        rss = handler.info["memory"]["rss_bytes"]
        assert handler.memory_budget == worker - rss > 0
        base = f"http://127.0.0.1:{srv.port}"
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10)) as c:
            assert (await _load(c)).stream_memory_budget_bytes == worker - rss
    finally:
        await srv.stop()
    plain = build_server(EngineConfig(model, server=ServerConfig(port=0)))
    assert plain.engine.active.worker_memory_bytes is None
