"""The memory-pressure governor: reads a memory probe, asks the policy, and swaps the engine's
active handler for another variant's while the utterances in progress finish where they started.

Make before break (both workers fit): start and warm the new handler, route new requests to it,
retire the old one in the background. Break before make: hold new requests, drain and stop the
old handler (its memory returns), load the new one, release the held requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler, HandlerError
from qwen3_tts_engine.dispatch.spare import SpareWorker
from qwen3_tts_engine.governor.budget import DEFAULT_BUDGET
from qwen3_tts_engine.governor.gate import check_rung
from qwen3_tts_engine.governor.memory import MemoryProbe, MemoryReading, detect_probe
from qwen3_tts_engine.governor.policy import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    MODES,
    Policy,
    PolicyState,
    after_swap,
    choose_mode,
    decide,
    effective_ladder,
    nominal_bits,
)
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.footprint import Footprints, checkpoint_weight_bytes
from qwen3_tts_engine.models.recipes import RECIPES, get_recipe
from qwen3_tts_engine.models.variants import resolve

# Niceness of a make-before-break swap's new worker until it serves (0: same as the old one);
# above 0 it is also idle-scheduled on Linux (worker/main.py renice), so the voices speaking
# on the old worker lose nothing to it; LOADING_PATIENCE bounds its wait.
LOADING_NICE = 10
LOADING_PATIENCE = 2.0  # x the old worker's start time, then the normal priority


class SwapInProgress(RuntimeError):
    pass


@dataclass
class SwapRecord:
    """One swap, as the status endpoint and the log tell it. Times in seconds from the decision."""

    id: int
    from_variant: str
    to_variant: str
    direction: str  # down | up
    cause: str  # pressure | critical | recovered | manual
    reason: str
    mode: str  # make-before-break | break-before-make
    decided_at: float = field(default_factory=time.time)  # wall clock
    reading: dict | None = None  # the memory reading behind the decision
    ok: bool | None = None  # None while in progress
    error: str | None = None
    latency_s: float | None = None  # decision -> the new variant serving
    drain_s: float | None = None  # waiting for the old handler's utterances to finish
    stop_s: float | None = None  # ending the old worker once drained
    load_s: float | None = None  # the new handler's start (spawn, load, warm-up)
    retired_s: float | None = None  # decision -> the old worker stopped
    cut: int = 0  # utterances cut because the hard drain deadline passed
    memory_before: dict | None = None
    memory_after: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


async def worker_memory(engine: Engine) -> dict:
    """The engine's own memory: the active worker, and all workers (retiring ones included)."""
    active = await engine.active.memory() if engine.active.state != "stopped" else {}
    total = 0
    for h in engine.all_handlers():
        if h.state != "stopped":
            total += (await h.memory()).get("rss_bytes", 0)
    return {"active_variant": engine.active.variant, "active_rss_bytes": active.get("rss_bytes"),
            "active_mlx_active_bytes": active.get("mlx_active_bytes"),
            "workers_rss_bytes": total}  # fmt: skip


class Governor:
    def __init__(
        self,
        engine: Engine,
        probe: MemoryProbe | None = None,
        policy: Policy | None = None,
        *,
        interval_s: float = 1.0,
        drain_deadline_s: float | None = None,
        auto: bool = True,
        clock: Callable[[], float] = time.monotonic,
        allow_unevaluated: Collection[str] = (),
        quality_budget: dict | None = None,
        quality_min_items: int = 6,
        spare_worker: bool = False,
    ) -> None:
        self.engine = engine
        # A worker process kept started (modules imported, no model) for the next swap's new
        # variant: its CPU during a swap under load is then the weights and warm-up only.
        self.spare_worker = spare_worker
        self._spare: SpareWorker | None = None
        # Quality gate: quantized rungs below the start need a stored report that passes this
        # budget (default: eval's) on enough items, or the operator's consent ("all" or names).
        self.allow_unevaluated = frozenset(allow_unevaluated)
        unknown = sorted(self.allow_unevaluated - set(RECIPES) - {"all"})
        if unknown:
            raise ValueError(f"--allow-unevaluated: unknown variant(s) {', '.join(unknown)}; "
                             f"valid: all, {', '.join(RECIPES)}")  # fmt: skip
        self.quality_budget = quality_budget
        self.quality_min_items = quality_min_items
        self.rung_checks: dict[str, dict] = {}
        self.probe = probe if probe is not None else detect_probe()
        self.configured = policy or Policy()
        self.policy = self.configured  # the ladder is cut at the start variant in start()
        self.interval_s = interval_s
        self.loading_nice = LOADING_NICE
        self.drain_deadline_s = drain_deadline_s  # operator-set: cut utterances after this long
        self.auto = auto
        self.clock = clock
        self.state = PolicyState()
        self.footprints = Footprints()
        self.started = False  # the ladder is fixed (quality gate checked) and memory read
        self.reading: MemoryReading | None = None
        self.pinned: str | None = None  # an operator's variant: no automatic swaps meanwhile
        self.swapping: SwapRecord | None = None
        self.history: deque[SwapRecord] = deque(maxlen=50)
        self.listeners: list[Callable[[SwapRecord], None]] = []  # called when a swap serves
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()  # retirements and shielded manual swaps
        self._ids = itertools.count(1)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """After the engine started: fix the ladder, estimate footprints, start the loop."""
        rungs, weights = await asyncio.to_thread(self._plan, str(self.engine.active.variant))
        self.policy = replace(self.configured, ladder=rungs)
        self.footprints = Footprints(weights)
        for h in self.engine.all_handlers():
            self.footprints.observe(h.variant, h.info.get("memory", {}), h.info.get("footprint"))
        self.reading = await self._read()
        self.started = True
        self._keep_spare()
        if self.auto:
            self._task = asyncio.create_task(self._loop(), name="qwen3-tts governor")
        logger.info("governor: ladder %s, memory from %s (pressure %.2f), %s", " > ".join(rungs),
                    self.probe.source, self.reading.pressure,
                    "automatic" if self.auto else "manual swaps only")  # fmt: skip

    async def stop(self) -> None:
        self.spare_worker = False  # no new spare from here on
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._retiring):
            t.cancel()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._spare is not None:
            spare, self._spare = self._spare, None
            await asyncio.to_thread(spare.close)

    def _keep_spare(self) -> None:
        """Start a spare worker if the governor keeps one and has none (after a swap took it)."""
        if self.spare_worker and (self._spare is None or not self._spare.proc.is_alive()):
            self._spare = SpareWorker()

    def _take_spare(self) -> SpareWorker | None:
        spare, self._spare = self._spare, None
        return spare

    def _plan(self, start: str) -> tuple[tuple[str, ...], dict[str, int]]:
        """The rungs this model can load (file reads: run in a thread) and their weight bytes."""
        rungs = tuple(v for v in effective_ladder(self.configured.ladder, start)
                      if (v == start or self._loadable(v)) and self._passes_gate(v, start))  # fmt: skip
        model_dir = Path(self.engine.model).expanduser()
        if not model_dir.is_dir():
            return rungs, {}
        return rungs, checkpoint_weight_bytes(
            model_dir, rungs, self.engine.active.loaded_compute_dtype
        )

    async def settle(self) -> None:
        """Wait until the handlers that swaps replaced have finished their work and stopped."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def _passes_gate(self, variant: str, start: str) -> bool:
        budget = self.quality_budget if self.quality_budget is not None else DEFAULT_BUDGET
        check = check_rung(self.engine.model, variant, start=start, consent=self.allow_unevaluated,
                           budget=budget, min_items=self.quality_min_items)  # fmt: skip
        self.rung_checks[variant] = check
        if not check["accepted"]:
            logger.warning("governor: %s is left off the ladder: %s", variant, check["why"])
        elif check["why"].startswith("operator consent"):
            logger.warning("governor: %s is on the ladder without a passing quality report "
                           "(operator consent)", variant)  # fmt: skip
        return check["accepted"]

    def _loadable(self, variant: str) -> bool:
        try:
            resolve(self.engine.model, variant)
            return True
        except (ValueError, FileNotFoundError) as e:
            logger.warning("governor: %s is left off the ladder: %s", variant, e)
            return False

    async def _read(self) -> MemoryReading:
        self.reading = await asyncio.to_thread(self.probe.read)
        return self.reading

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a failed step must not end the governor
                logger.exception("governor step failed")
            await asyncio.sleep(self.interval_s)

    # -- decisions ----------------------------------------------------------------------------

    @property
    def position(self) -> int | None:
        variant = self.engine.active.variant
        return self.policy.ladder.index(variant) if variant in self.policy.ladder else None

    def _footprint_map(self) -> dict[str, int | None]:
        return {v: self.footprints.get(v) for v in self.policy.ladder}

    async def step(self) -> SwapRecord | None:
        """Read memory once; swap if the policy says so."""
        reading = await self._read()
        if self.pinned is not None or self._lock.locked() or not self.engine.serving:
            return None
        decision, self.state = decide(self.policy, self.state, reading,
                                      str(self.engine.active.variant), self._footprint_map(),
                                      self.clock())  # fmt: skip
        if decision is None:
            return None
        return await self._swap(decision.target, decision.direction, decision.cause,
                                decision.reason, None)  # fmt: skip

    async def request(
        self, variant: str, *, mode: str = "auto", pin: bool = True
    ) -> SwapRecord | None:
        """An operator's swap. "auto" unpins (the policy decides again); None: nothing to swap."""
        if mode not in MODES:
            raise ValueError(f"unknown swap mode {mode!r}; one of {', '.join(MODES)}")
        if variant == "auto":
            self.pinned = None
            self.state = PolicyState(last_swap_at=self.state.last_swap_at)
            return None
        get_recipe(variant)  # ValueError names the valid ones
        await asyncio.to_thread(resolve, self.engine.model, variant)
        if self._lock.locked():
            raise SwapInProgress("a variant swap is already in progress")
        current = str(self.engine.active.variant)
        # Off the ladder the policy has no rung to start from, so the choice stays pinned.
        self.pinned = variant if pin or variant not in self.policy.ladder else None
        if variant == current:
            return None
        ladder = self.policy.ladder
        if variant in ladder and current in ladder:
            direction = "down" if ladder.index(variant) > ladder.index(current) else "up"
        else:
            direction = "down" if nominal_bits(variant) < nominal_bits(current) else "up"
        reason = "operator request" + (" (pinned)" if self.pinned else "")
        # Shielded: a caller that goes away (HTTP client disconnect) must not stop a swap halfway.
        task = asyncio.ensure_future(self._swap(variant, direction, "manual", reason,
                                                None if mode == "auto" else mode))  # fmt: skip
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        rec = await asyncio.shield(task)
        if not rec.ok:
            self.pinned = None  # the variant asked for is not serving: let the policy decide
        return rec

    # -- swapping -----------------------------------------------------------------------------

    async def _swap(self, target: str, direction: str, cause: str, reason: str,
                    mode: str | None) -> SwapRecord:  # fmt: skip
        async with self._lock:
            old = self.engine.active
            mode = mode or choose_mode(self.policy, self.reading, self.footprints.get(target))
            rec = SwapRecord(next(self._ids), str(old.variant), target, direction, cause, reason,
                             mode, reading=self.reading.as_dict() if self.reading else None,
                             memory_before=await worker_memory(self.engine))  # fmt: skip
            self.swapping = rec
            t0 = self.clock()
            try:
                if mode == MAKE_BEFORE_BREAK:
                    await self._make_before_break(old, rec, t0)
                else:
                    await self._break_before_make(old, rec, t0)
            finally:
                self.swapping = None
            self.history.append(rec)
            return rec

    async def _make_before_break(self, old: Handler, rec: SwapRecord, t0: float) -> None:
        new = old.sibling(rec.to_variant)
        # The new worker loads at a lower CPU priority while the old one may be speaking, and
        # gets the normal one back before it serves (bench/swap.py measures both sides). On a
        # machine busy with more than the old worker, a niced load would starve: past twice the
        # old worker's own start time it continues at the normal priority.
        new.nice = self.loading_nice
        try:
            starting = asyncio.ensure_future(new.start(spare=self._take_spare()))
            if new.nice:
                patience = LOADING_PATIENCE * old.info.get("start_s", 5.0)
                done, _ = await asyncio.wait({starting}, timeout=patience)
                if not done and new.set_nice(0):
                    logger.info("variant swap %s -> %s: still loading after %.1fs at niceness "
                                "%d; continuing at the normal priority", rec.from_variant,
                                rec.to_variant, patience, self.loading_nice)  # fmt: skip
            await starting
        except HandlerError as e:  # the old handler never stopped serving
            rec.ok, rec.error, rec.load_s = False, str(e), self.clock() - t0
            self._done(rec, None, t0)
            return
        rec.load_s = new.info.get("start_s")
        if new.nice:
            new.set_nice(0)
        old.restart = False  # a worker dying while it retires is not brought back
        self.engine.route_to(new, old)
        rec.ok = True
        self._done(rec, new, t0)
        task = asyncio.create_task(self._retire(old, rec, t0), name=f"retire {old.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, old: Handler, rec: SwapRecord, t0: float) -> None:
        await self._drain_and_stop(old, rec)  # if cancelled (shutdown), Engine.stop ends it
        self.engine.forget(old)
        rec.retired_s = self.clock() - t0
        rec.memory_after = await worker_memory(self.engine)
        self._keep_spare()  # for the next swap, now that the old worker's memory is back

    async def _break_before_make(self, old: Handler, rec: SwapRecord, t0: float) -> None:
        self.engine.hold(rec.to_variant)  # new requests wait in Engine.acquire, none are dropped
        restart = old.restart
        old.restart = False
        await self._drain_and_stop(old, rec)
        rec.retired_s = self.clock() - t0
        new = old.sibling(rec.to_variant)
        new.restart = restart
        try:
            await new.start(spare=self._take_spare())
            rec.ok = True
        except HandlerError as e:
            rec.ok, rec.error = False, str(e)
            logger.error("variant swap %s -> %s failed: %s; loading %s again", rec.from_variant,
                         rec.to_variant, e, rec.from_variant)  # fmt: skip
            new = old.sibling(old.variant)  # it fitted before
            new.restart = restart
            try:
                await new.start()
            except HandlerError as e2:
                rec.error += f"; reloading {rec.from_variant} failed too: {e2}"
                self.engine.resume()  # waiting requests get a 503 rather than hang
                self._done(rec, None, t0)
                return
        rec.load_s = new.info.get("start_s")
        self.engine.route_to(new, old)
        self._done(rec, new, t0)
        rec.memory_after = await worker_memory(self.engine)
        self._keep_spare()

    async def _drain_and_stop(self, old: Handler, rec: SwapRecord) -> None:
        """Let the old handler finish what it is speaking (up to the hard deadline), then end
        its worker so that its memory returns to the system."""
        t = self.clock()
        await old.drain(self.drain_deadline_s)
        rec.drain_s = self.clock() - t
        rec.cut = old.in_flight
        if rec.cut:
            logger.warning("variant swap %s -> %s: hard deadline of %.1fs passed; cutting %d "
                           "utterance(s) on %s", rec.from_variant, rec.to_variant,
                           self.drain_deadline_s, rec.cut, old.variant)  # fmt: skip
        self.footprints.observe(old.variant, await old.memory())
        # Drained, it is idle (or past the deadline): no need to wait for its interpreter's
        # teardown; the memory returns to the system as soon as the process is gone.
        t = self.clock()
        await old.stop(drain=False, grace=0.0)
        rec.stop_s = self.clock() - t

    def _done(self, rec: SwapRecord, new: Handler | None, t0: float) -> None:
        """The swap's outcome is known: cool-down, footprint, the one log line, the listeners."""
        rec.latency_s = self.clock() - t0
        self.state = after_swap(self.state, self.clock())
        if new is not None:
            self.footprints.observe(
                new.variant, new.info.get("memory", {}), new.info.get("footprint")
            )
        if rec.ok:
            logger.info("variant swap %s -> %s (%s, %s, %s) serving after %.2fs: %s",
                        rec.from_variant, rec.to_variant, rec.direction, rec.mode, rec.cause,
                        rec.latency_s, rec.reason)  # fmt: skip
        else:
            logger.error("variant swap %s -> %s (%s, %s) failed after %.2fs: %s (reason: %s)",
                         rec.from_variant, rec.to_variant, rec.direction, rec.mode, rec.latency_s,
                         rec.error, rec.reason)  # fmt: skip
        if not rec.ok:  # a failed load used up the spare, if it took one
            self._keep_spare()
        for listener in self.listeners:
            listener(rec)

    # -- visibility ---------------------------------------------------------------------------

    async def status(self) -> dict:
        return {
            "automatic": self.auto and self.pinned is None, "pinned": self.pinned,
            "ladder": list(self.policy.ladder), "position": self.position,
            "active_variant": self.engine.active.variant,
            "pressure": self.reading.as_dict() if self.reading else None,
            "memory_source": self.probe.source,
            "footprints": self.footprints.as_dict(self.policy.ladder),
            "engine_memory": await worker_memory(self.engine),
            "policy": asdict(self.policy), "drain_deadline_s": self.drain_deadline_s,
            "note": self.state.note,
            "swapping": self.swapping.as_dict() if self.swapping else None,
            "retiring": [h.name for h in self.engine.retiring],
            "spare_worker": {"pid": self._spare.pid} if self._spare is not None else None,
            "history": [r.as_dict() for r in self.history],
            "quality_gate": {"allow_unevaluated": sorted(self.allow_unevaluated),
                             "budget": self.quality_budget or "qwen3-tts eval's default",
                             "min_items": self.quality_min_items,
                             "rungs": self.rung_checks},
        }  # fmt: skip


__all__ = ["BREAK_BEFORE_MAKE", "MAKE_BEFORE_BREAK", "Governor", "SwapInProgress", "SwapRecord"]
