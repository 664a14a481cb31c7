"""The real-time capacity model and the FIFO admission (`dispatch/capacity.py`), on step times
given as data (what the worker reports), so every answer follows from the numbers here."""

from __future__ import annotations

import asyncio
import math

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
    assert model.slots(0.080, 8) == 2  # 3 fits the prediction, but slots open one size at a time
    model.observe(3, 0.045)  # batching is cheaper than that: three streams in 45 ms
    # two sizes: the least-squares line through the three samples, 15 ms + 10 ms per stream
    assert model.fit() == pytest.approx((0.015, 0.010))
    assert model.predict(2) == pytest.approx(0.035)
    assert model.predict(3) == pytest.approx(0.045)  # a size seen: its mean
    assert model.predict(5) == pytest.approx(0.065)
    assert (
        model.slots(0.080, 8) == 4 and model.slots(0.080, 4) == 4
    )  # 6 fit; 4: one past 3 measured
    model.observe(4, 0.055)
    model.observe(5, 0.065)
    assert model.slots(0.080, 8) == 6
    for _ in range(4):  # the host slowed down: the window forgets the fast steps
        model.observe(1, 0.070)
        model.observe(3, 0.210)
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


def _feed(model: StepModel, at: float, sizes, cost, steps: int = 16, every: float = 0.1) -> float:
    """`steps` steps of each size in `sizes` in turn, one every `every` seconds from `at`, each
    taking `cost(size)` seconds; returns the time after the last."""
    for _ in range(steps):
        for n in sizes:
            model.observe(n, cost(n), at=at)
            at += every
    return at


def test_slots_fall_under_a_slowdown_and_come_back_after_it():
    """Samples age by the steps: a slow spell at a size that admission then never runs again is
    forgotten once the engine has run a minute (MAX_AGE_S) at the sizes it admits."""
    now = 0.0
    model = StepModel(clock=lambda: now)
    budget = 0.085

    def fast(n):
        return 0.020 + 0.010 * n  # 6 streams: 80 ms

    t = _feed(model, 0.0, (1, 2, 3, 4, 5, 6), fast)
    assert model.slots(budget, 8) == 6
    t = _feed(model, t, (3,), lambda n: 0.150)  # a slow spell at 3 streams: 150 ms a step
    assert model.measured()[3] == pytest.approx(0.150)
    assert model.slots(budget, 8) == 2  # admission now caps the batch at 2
    now = t + 3600.0  # an idle hour forgets nothing: the age runs on the steps
    assert model.slots(budget, 8) == 2 and 3 in model.measured()
    t = _feed(model, t, (1, 2), fast, steps=500)  # 1,000 fast steps at 1 and 2 streams, 100 s
    assert 3 not in model.measured()  # the slow spell aged out (and the sizes above it)
    assert model.slots(budget, 8) == 3  # the line through 1 and 2 streams opens 3 at once
    for n in (3, 4, 5):  # admission runs each size the slots open, its steps open the next
        t = _feed(model, t, (n,), fast, steps=4)
        assert model.slots(budget, 8) == n + 1
    assert model.slots(budget, 8) == 6  # back
    copy = model.copy()  # a swap's handler starts from these steps, ageing alike
    _feed(copy, t + 61.0, (1,), fast, steps=1)
    assert set(copy.measured()) == {1} and set(model.measured()) == {1, 2, 3, 4, 5}


def test_batching_that_is_cheap_per_stream_gives_more_slots_than_the_proportion():
    """Steps of 50 ms x sqrt(streams): with one size seen the prediction stays proportional
    (conservative); with two, the least-squares line finds the fixed cost and admits more."""

    def cost(n):
        return 0.050 * math.sqrt(n)

    budget = 0.095
    model = StepModel()
    _feed(model, 0.0, (1,), cost, steps=4)
    assert model.fit() is None and model.predict(2) == pytest.approx(0.100)
    assert model.slots(budget, 8) == 1  # 2 streams would fit (71 ms), but nothing says so yet
    _feed(model, 1.0, (2,), cost, steps=4)
    fixed, per_stream = model.fit()
    assert fixed == pytest.approx(0.0293, abs=1e-4) and per_stream == pytest.approx(
        0.0207, abs=1e-4
    )
    proportional = max(n for n in range(1, 9) if cost(2) * n / 2 <= budget)  # the old rule
    assert proportional == 2
    assert model.predict(3) == pytest.approx(fixed + 3 * per_stream) and model.predict(3) <= budget
    assert model.slots(budget, 8) == 3 > proportional
    curve = model.curve(8)
    assert all(curve[n] <= curve[n + 1] for n in range(1, 8))  # never falls with the size


def test_a_fit_never_prices_a_larger_batch_below_a_smaller_one():
    model = StepModel()
    for _ in range(4):
        model.observe(1, 0.060)
        model.observe(2, 0.040)  # noise: two streams measured cheaper than one
    assert model.fit()[1] == 0.0  # the per-stream cost is never negative
    curve = model.curve(4)
    assert curve[2] == curve[3] == curve[4] == pytest.approx(0.060)


async def test_the_probe_admits_one_more_only_while_requests_wait_and_at_most_every_interval():
    now = 0.0
    limit = 1
    gate = Admission(lambda: limit, most=3, probe_every_s=30.0, clock=lambda: now)
    await gate.acquire()  # a
    gate.wake(probe=True)
    assert gate.running == 1 and gate.probes == 0  # nobody waits: nothing to try
    b, c = asyncio.create_task(gate.acquire()), asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    now = 29.9
    gate.wake(probe=True)
    gate.wake()  # a wake that is not a step report never probes
    await asyncio.sleep(0)
    assert not b.done() and gate.running == 1  # they have not waited 30 s yet
    now = 30.0
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert b.done() and not c.done() and (gate.running, gate.probes) == (2, 1)  # one, in order
    now = 45.0
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert not c.done() and gate.running == 2  # over the limit already: no second probe
    gate.release()  # a ends: 1 runs, the limit
    now = 59.9
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert not c.done()  # c has waited long enough, but the last probe was under 30 s ago
    now = 60.0
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert c.done() and (gate.running, gate.probes) == (2, 2)
    limit = 3  # at max_batch: there is no larger size to try
    d = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert d.done() and gate.running == 3
    e = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    now = 1000.0
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert not e.done() and gate.probes == 2
    e.cancel()


async def test_a_probe_that_fits_raises_the_slots():
    """A fresh engine knows one size (50 ms, over half of 95 ms: 1 slot); a probe measures two
    streams at 71 ms (50 ms x sqrt(2)), and the line through both sizes admits a third."""
    now = 0.0
    budget = 0.095
    model = StepModel(clock=lambda: now)
    for _ in range(4):
        model.observe(1, 0.050)
    gate = Admission(lambda: model.slots(budget, 8), most=8, probe_every_s=30.0, clock=lambda: now)
    await gate.acquire()
    waiting = [asyncio.create_task(gate.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    now = 30.0
    gate.wake(probe=True)
    await asyncio.sleep(0)
    assert [w.done() for w in waiting] == [True, False, False] and gate.running == 2
    for _ in range(4):  # the probe's steps: two streams fit
        model.observe(2, 0.050 * math.sqrt(2))
    gate.wake(probe=True)  # the step report
    await asyncio.sleep(0)
    assert model.slots(budget, 8) == 3 and [w.done() for w in waiting] == [True, True, False]
    assert gate.probes == 1  # the third came in by the slots, not by a probe
    waiting[2].cancel()


async def test_a_held_request_lends_its_slot_and_takes_it_back_ahead_of_new_ones():
    gate = Admission(lambda: 1, max_parked=1, fits=lambda costs: sum(costs) <= 10)
    order: list[str] = []

    async def take(name: str, cost: int) -> None:
        await gate.acquire(cost)
        order.append(name)

    await take("a", 4)
    b = asyncio.create_task(take("b", 4))
    await asyncio.sleep(0)
    assert order == ["a"]
    assert gate.park(4)  # a is held (its consumer or text is behind): b starts in its slot
    await b
    assert (gate.running, gate.parked, gate.costs) == (1, [4], [4, 4])
    assert not gate.park(4)  # b is held too, over max_parked: it keeps its slot
    c = asyncio.create_task(take("c", 1))
    await asyncio.sleep(0)
    assert "c" not in order
    gate.release(4)  # b ends; c has the slot, and its memory (a's still counts) fits
    await c
    d = asyncio.create_task(take("d", 4))
    await asyncio.sleep(0)
    assert "d" not in order and gate.held_by_memory is False  # no slot: c runs, a lent its own
    gate.unpark(4)  # a resumes at once, over the limit, ahead of d
    assert gate.running == 2 and gate.parked == []
    gate.release(1)
    await asyncio.sleep(0)
    assert "d" not in order  # still one running (a): d waits for it
    gate.release(4)
    await d
    assert order == ["a", "b", "c", "d"] and gate.running == 1
