"""The real-time capacity model and the FIFO admission (`dispatch/capacity.py`), on step times
given as data (what the worker reports), so every answer follows from the numbers here."""

from __future__ import annotations

import asyncio

import pytest

from qwen3_tts_engine.dispatch.capacity import Admission, StepModel, parse_budget_ms


def test_the_budget_setting():
    assert parse_budget_ms(None) == parse_budget_ms("") == pytest.approx(0.080)
    assert parse_budget_ms("120") == pytest.approx(0.120)
    assert parse_budget_ms("off") is None and parse_budget_ms("OFF") is None
    for bad in ("fast", "-5"):
        with pytest.raises(ValueError, match="frame budget"):
            parse_budget_ms(bad)


def test_slots_follow_the_measured_steps():
    model = StepModel(window=4)
    assert model.predict(1) is None and model.slots(0.080, 8) == 1  # nothing measured: one stream
    assert model.slots(None, 8) == 8  # no budget: the configured rows
    for seconds in (0.020, 0.030):  # one stream: 25 ms a step on average
        model.observe(1, seconds)
    assert model.predict(1) == pytest.approx(0.025)
    # unseen sizes: in proportion to the largest smaller size seen (at most that much per stream)
    assert model.predict(3) == pytest.approx(0.075) and model.predict(4) == pytest.approx(0.100)
    assert model.slots(0.080, 8) == 3
    model.observe(3, 0.045)  # batching is cheaper than that: three streams in 45 ms
    assert model.predict(2) == pytest.approx(0.050)  # from one stream's 25 ms
    assert model.predict(3) == pytest.approx(0.050)  # never below a smaller size's prediction
    assert model.predict(5) == pytest.approx(0.075)  # 45 ms x 5/3 beats 25 ms x 5 as the prior
    assert model.slots(0.080, 8) == 5 and model.slots(0.080, 4) == 4
    for _ in range(4):  # the host slowed down: the window forgets the fast steps
        model.observe(1, 0.070)
    assert model.slots(0.080, 8) == 1
    copy = model.copy()
    copy.observe(1, 0.001)
    assert model.predict(1) == pytest.approx(0.070)  # a copy is independent


async def test_admission_is_fifo_within_a_limit_that_can_change():
    limit = 1
    gate = Admission(lambda: limit)
    order: list[str] = []

    async def take(name: str) -> None:
        await gate.acquire()
        order.append(name)

    await take("a")
    waiting = [asyncio.create_task(take(n)) for n in "bcd"]
    await asyncio.sleep(0)
    assert order == ["a"] and gate.running == 1
    waiting[0].cancel()  # b leaves the queue: it never holds a slot
    limit = 3
    gate.wake()  # the limit grew (a step report)
    await asyncio.gather(*waiting[1:])
    assert order == ["a", "c", "d"] and gate.running == 3
    limit = 1
    gate.release()
    assert gate.running == 2  # over the new limit: nobody else starts until two leave
    late = asyncio.create_task(take("e"))
    await asyncio.sleep(0)
    gate.release()
    await asyncio.sleep(0)
    assert "e" not in order
    gate.release()
    await late
    assert order[-1] == "e" and gate.running == 1
