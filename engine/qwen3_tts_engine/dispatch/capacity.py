"""Real-time capacity of one handler: how many streams its worker keeps in real time.

A batch step makes one 80 ms frame for every stream in it, so the batch keeps real time while
a step takes at most the frame budget (80 ms: the time a frame plays for). The worker times
every step and reports (streams in the step, seconds) over the pipe (`messages.StepTimes`);
`StepModel` keeps the recent steps per batch size and predicts a step's time for any size, and
`slots` is the most streams whose predicted step stays within the budget (at least 1, at most
`max_batch`). `Admission` starts queued requests in order while fewer than that many run.

The prediction for a size never seen is conservative: the largest smaller size seen, scaled in
proportion (a batch costs at most that much per stream), and never below a smaller size's. So a
fresh engine serves one stream, measures, and admits a second once one stream's steps show room,
and so on up (its steps prove the next size); before any step it has 1 slot. Every prediction is
at least what the measured steps say a step of that size costs per stream times its streams, so
steps slowed by a fixed time per stream (the fault injection) bound the slots whatever else
the machine does.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable

from qwen3_tts_engine.protocol import FRAME_RATE

FRAME_S = 1 / FRAME_RATE  # the time one frame plays for: 80 ms
BUDGET_ENV = "QWEN3_TTS_FRAME_BUDGET_MS"
WINDOW = 16  # steps kept per batch size: four 4-frame chunks, so vocoder steps are averaged in


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
    """Recent step times by batch size, and the predicted step time of any size."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._steps: dict[int, deque[float]] = {}

    def observe(self, streams: int, seconds: float) -> None:
        if streams < 1:
            return
        self._steps.setdefault(streams, deque(maxlen=self.window)).append(seconds)

    def copy(self) -> StepModel:
        other = StepModel(self.window)
        other._steps = {n: deque(s, maxlen=self.window) for n, s in self._steps.items()}
        return other

    def measured(self) -> dict[int, float]:
        """Mean recent step time per batch size seen."""
        return {n: sum(s) / len(s) for n, s in sorted(self._steps.items()) if s}

    def curve(self, upto: int) -> dict[int, float]:
        """Predicted step seconds for 1..`upto` streams (empty before any step): a size seen, its
        mean; an unseen one, the largest smaller size seen scaled in proportion (or, with none,
        the smallest larger size's time); never below a smaller size's prediction."""
        measured = self.measured()
        out: dict[int, float] = {}
        if not measured:
            return out
        previous = 0.0
        for n in range(1, upto + 1):
            smaller = [m for m in measured if m < n]
            if n in measured:
                seconds = measured[n]
            elif smaller:
                seconds = measured[max(smaller)] * n / max(smaller)
            else:
                seconds = min(v for m, v in measured.items() if m > n)
            previous = out[n] = max(seconds, previous)
        return out

    def predict(self, streams: int) -> float | None:
        """Predicted seconds of a step with `streams` rows (None before any step)."""
        return self.curve(streams).get(streams)

    def slots(self, budget_s: float | None, max_batch: int) -> int:
        """The most streams (1..max_batch) whose predicted step stays within `budget_s`."""
        if budget_s is None:
            return max_batch
        fitting = [n for n, seconds in self.curve(max_batch).items() if seconds <= budget_s]
        return max([1, *fitting])  # the curve never falls: the fitting sizes are 1..slots


class Admission:
    """FIFO admission: a request starts while fewer than `limit()` requests run; the others wait
    in arrival order. `wake()` re-checks after the limit changed (a step report)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> None:
        if not self._waiters and self.running < self.limit():
            self.running += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted while it was being cancelled: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        self.running -= 1
        self.wake()

    def wake(self) -> None:
        while self._waiters and self.running < self.limit():
            fut = self._waiters.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)
