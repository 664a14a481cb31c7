"""Real-time capacity of one handler: how many streams its worker keeps in real time.

A batch step makes one 80 ms frame for every stream in it, so the batch keeps real time while
a step takes at most the frame budget (80 ms: the time a frame plays for). The worker times
every step and reports (streams in the step, seconds) over the pipe (`messages.StepTimes`);
`StepModel` keeps the recent steps per batch size and predicts a step's time for any size, and
`slots` is the most streams whose predicted step stays within the budget (at least 1, at most
`max_batch`). `Admission` starts queued requests in order while fewer than that many run, and,
beside that rule, while the memory of the streams running and the next one fits the worker's
memory budget (`fits`: the handler's, `models/stream_memory.py` counts the bytes), so that a
batch does not grow into the governor's watermark and make it swap.

The model learns both ways:
- Samples age. Each size keeps its last `WINDOW` steps, and a sample older than `MAX_AGE_S`
  (60 s) before the newest sample of any size is dropped. The age runs on the steps, not on the
  wall clock: an idle engine forgets nothing, but one that has run a minute at small sizes
  forgets an old slow spell at a larger size (which admission, capped at the slots, would never
  run again to correct).
- A size never seen is predicted from the sizes seen. From one size, conservatively as a batch
  costing at most that much per stream (in proportion above it, the same time below it). From
  two sizes or more, by a least-squares line over their recent samples, fixed cost + per-stream
  cost x streams with the per-stream cost at least 0 (batching is cheap: the real 0.6B's four
  streams cost 1.9x one stream's step, where the proportion would say 4x). Every prediction is
  at least a smaller size's, so the curve never falls.
- When streams wait, `Admission` now and then admits one more than the slots (at most once every
  `PROBE_EVERY_S`, 30 s, of waiting, and only below `max_batch`): its steps measure the next
  size, and the slots grow if they fit (else no one else starts until the batch is back within
  the slots). This is how a fresh engine, which knows one size, learns a second one without
  a proportion that over-predicts it.

Slots open one size at a time: at most one more than the largest size measured.

Held streams lend their slots. A stream with nothing to compute (its consumer has not taken
its chunks, or its streamed text is open and used up: `messages.Held`) is `park`ed: it leaves
`running`, so a waiting request may start in its slot, while its memory still counts (its
cache rows are kept for it). When it can run again it takes a slot back at once (`unpark`),
ahead of every waiting request and even over the limit: it was admitted, its listener is
waiting, and its KV cache is already built; the batch is then over its slots until streams
end, and no new request starts meanwhile. At most `max_parked` streams lend their slots (the
handler: two per batch row); one more keeps its slot, as before, so held streams cannot pile
up without bound.

Steps slowed by a fixed time per stream (the fault injection, `messages.StepDelay`) put at least
that time per stream into every measured size, so a measured size over the budget stays over it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable

from qwen3_tts_engine.protocol import FRAME_RATE

FRAME_S = 1 / FRAME_RATE  # the time one frame plays for: 80 ms
BUDGET_ENV = "QWEN3_TTS_FRAME_BUDGET_MS"
WINDOW = 16  # steps kept per batch size: four 4-frame chunks, so vocoder steps are averaged in
MAX_AGE_S = 60.0  # a sample this much older than the newest sample (of any size) is dropped
PROBE_EVERY_S = 30.0  # while streams wait, one stream over the slots at most this often
PARKED_PER_ROW = 2  # held streams that lend their slots, per batch row (`Admission.max_parked`)


def parse_budget_ms(text: str | None) -> float | None:
    """A frame budget setting in seconds: "80" -> 0.08; "off" (or "none", "0") -> None (no budget:
    slots = max_batch). Raises ValueError for anything else."""
    if text is None or text.strip() == "":
        return FRAME_S
    value = text.strip().lower()
    if value in ("off", "none", "0"):
        return None
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"frame budget must be milliseconds or 'off', got {text!r}") from None
    if ms < 0:
        raise ValueError(f"frame budget must be positive or 'off', got {text!r}")
    return ms / 1000.0


def default_frame_budget() -> float | None:
    """The frame budget from QWEN3_TTS_FRAME_BUDGET_MS (default 80 ms; "off": none)."""
    return parse_budget_ms(os.environ.get(BUDGET_ENV))


class StepModel:
    """Recent step times by batch size, and the predicted step time of any size.

    `max_age_s`: samples this much older than the newest one are dropped (None: never); `clock`:
    the time a sample is observed at, unless `observe` is given one."""

    def __init__(self, window: int = WINDOW, *, max_age_s: float | None = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.window = window
        self.max_age_s = max_age_s
        self.clock = clock
        self._steps: dict[int, deque[tuple[float, float]]] = {}  # size -> (observed at, seconds)
        self._newest: float | None = None

    def observe(self, streams: int, seconds: float, at: float | None = None) -> None:
        if streams < 1:
            return
        at = self.clock() if at is None else at
        self._steps.setdefault(streams, deque(maxlen=self.window)).append((at, seconds))
        self._newest = at if self._newest is None else max(self._newest, at)
        self._forget()

    def _forget(self) -> None:
        """Drop the samples older than `max_age_s` before the newest one."""
        if self.max_age_s is None or self._newest is None:
            return
        oldest = self._newest - self.max_age_s
        for n in list(self._steps):
            samples = self._steps[n]
            while samples and samples[0][0] < oldest:
                samples.popleft()
            if not samples:
                del self._steps[n]

    def copy(self) -> StepModel:
        other = StepModel(self.window, max_age_s=self.max_age_s, clock=self.clock)
        other._steps = {n: deque(s, maxlen=self.window) for n, s in self._steps.items()}
        other._newest = self._newest
        return other

    def measured(self) -> dict[int, float]:
        """Mean recent step time per batch size seen."""
        return {n: sum(v for _, v in s) / len(s) for n, s in sorted(self._steps.items()) if s}

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per stream): the least-squares line through the recent samples
        of every size, per-stream cost at least 0 (None with fewer than two sizes seen)."""
        points = [(n, v) for n, s in self._steps.items() for _, v in s]
        if len({n for n, _ in points}) < 2:
            return None
        mean_n = sum(n for n, _ in points) / len(points)
        mean_v = sum(v for _, v in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        per_stream = max(0.0, sum((n - mean_n) * (v - mean_v) for n, v in points) / spread)
        return mean_v - per_stream * mean_n, per_stream

    def curve(self, upto: int) -> dict[int, float]:
        """Predicted step seconds for 1..`upto` streams (empty before any step): a size seen, its
        mean; an unseen one, from the fit of the sizes seen (with one size: in proportion above
        it, its time below it); never below a smaller size's prediction."""
        measured = self.measured()
        out: dict[int, float] = {}
        if not measured:
            return out
        line = self.fit()
        smallest = min(measured)
        previous = 0.0
        for n in range(1, upto + 1):
            if n in measured:
                seconds = measured[n]
            elif line is not None:
                fixed, per_stream = line
                seconds = max(0.0, fixed + per_stream * n)
                if n < smallest:  # below every size seen: no dearer than the smallest
                    seconds = min(seconds, measured[smallest])
            elif n > smallest:  # the one size seen: at most that much per stream
                seconds = measured[smallest] * n / smallest
            else:
                seconds = measured[smallest]
            previous = out[n] = max(seconds, previous)
        return out

    def predict(self, streams: int) -> float | None:
        """Predicted seconds of a step with `streams` rows (None before any step)."""
        return self.curve(streams).get(streams)

    def slots(self, budget_s: float | None, max_batch: int) -> int:
        """The most streams (1..max_batch) whose predicted step stays within `budget_s`, and at
        most one more than the largest size measured: a prediction may open the next size, only
        a measurement the one after (a noisy fit, flat where a larger batch happened to step
        faster, would otherwise open every size at once)."""
        if budget_s is None:
            return max_batch
        ceiling = max(self.measured(), default=0) + 1
        fitting = [
            n
            for n, seconds in self.curve(max_batch).items()
            if seconds <= budget_s and n <= ceiling
        ]
        return max([1, *fitting])  # the curve never falls: the fitting sizes are 1..slots


class Admission:
    """FIFO admission: a request starts while fewer than `limit()` requests run and, where there
    is a memory rule, `fits(costs)` holds for the costs of the requests running or parked and its
    own (a request's cost: its frame budget); the others wait in arrival order. `wake()`
    re-checks after the limit changed (a step report). A request starts when none runs or is
    parked whatever its cost (alone over the budget it would wait forever; the governor is the
    backstop). `park` / `unpark`: a held request lends its slot (module docstring).

    The probe: `wake(probe=True)` (the handler's step reports) admits one request over the limit
    when requests have waited `probe_every_s` without a break, no probe came in the last
    `probe_every_s`, exactly `limit()` run (not more: the batch already measures a larger size),
    and that is below `most` (max_batch). Its steps measure the size one over the slots."""

    def __init__(self, limit: Callable[[], int], *, most: int | None = None,
                 probe_every_s: float | None = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 fits: Callable[[list[int]], bool] | None = None,
                 max_parked: int | None = None) -> None:  # fmt: skip
        self.limit = limit
        self.most = most  # None: no probes
        self.probe_every_s = probe_every_s  # None: no probes
        self.clock = clock
        self.fits = fits  # None: no memory rule
        self.max_parked = max_parked  # None: any number of held requests lend their slots
        self.held: list[int] = []  # the costs of the requests running (holding a slot)
        self.parked: list[int] = []  # the costs of held requests that lent their slots
        self.probes = 0  # requests admitted over the limit so far
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()
        self._waiting_since: float | None = None  # the queue has not been empty since
        self._probed_at: float | None = None

    async def acquire(self, cost: int = 0) -> None:
        if not self._waiters and self.running < self.limit() and self._memory_allows(cost):
            self.held.append(cost)
            return
        fut = asyncio.get_running_loop().create_future()
        if not self._waiters:
            self._waiting_since = self.clock()
        entry = (fut, cost)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(cost)  # granted while it was being cancelled: pass it on
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self.wake()  # the next one may fit where this one did not
            raise

    def release(self, cost: int = 0) -> None:
        self.held.remove(cost)
        self.wake()

    def park(self, cost: int = 0) -> bool:
        """A running request is held: it lends its slot (its memory still counts) and a waiting
        one may start. False: `max_parked` requests already lend theirs (it keeps its slot)."""
        if self.max_parked is not None and len(self.parked) >= self.max_parked:
            return False
        self.held.remove(cost)
        self.parked.append(cost)
        self.wake()
        return True

    def unpark(self, cost: int = 0) -> None:
        """A held request runs again: it takes a slot back at once, over the limit if need be."""
        self.parked.remove(cost)
        self.held.append(cost)

    @property
    def costs(self) -> list[int]:
        """The costs whose memory is held: running requests and parked ones."""
        return [*self.held, *self.parked]

    @property
    def running(self) -> int:
        return len(self.held)

    @property
    def held_by_memory(self) -> bool:
        """The first waiter has a slot but not the memory: it starts when a stream ends."""
        if not self._waiters or self.running >= self.limit():
            return False
        return not self._memory_allows(self._head_cost())

    def _memory_allows(self, cost: int) -> bool:
        alone = self.running == 0 and not self.parked
        return self.fits is None or alone or self.fits([*self.costs, cost])

    def _head_fits(self) -> bool:
        """A request waits and the first one's memory fits."""
        cost = self._head_cost()
        return bool(self._waiters) and self._memory_allows(cost)

    def _head_cost(self) -> int:
        while self._waiters and self._waiters[0][0].done():
            self._waiters.popleft()  # left (cancelled) before its turn
        return self._waiters[0][1] if self._waiters else 0

    def wake(self, probe: bool = False) -> None:
        limit = self.limit()
        while self.running < limit and self._head_fits():
            self._grant()
        if probe and self.running == limit and self._may_probe(limit) and self._head_fits():
            while self._waiters:
                if self._grant():
                    self._probed_at = self.clock()
                    self.probes += 1
                    break

    def _may_probe(self, limit: int) -> bool:
        if self.most is None or self.probe_every_s is None or limit >= self.most:
            return False
        now = self.clock()
        waited = self._waiting_since is not None and now - self._waiting_since >= self.probe_every_s
        return waited and (self._probed_at is None or now - self._probed_at >= self.probe_every_s)

    def _grant(self) -> bool:
        """Start the first waiter (False: it had left)."""
        fut, cost = self._waiters.popleft()
        if fut.done():
            return False
        self.held.append(cost)
        fut.set_result(None)
        return True
