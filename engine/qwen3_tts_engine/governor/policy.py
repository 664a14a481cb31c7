"""The memory-pressure policy: when to move down or up the ladder of variants, and how to swap.

Pure functions of memory readings, footprints and a clock (no I/O, no sleeping), so hysteresis,
cool-down and the fit checks are tested with simulated time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from qwen3_tts_engine.governor.memory import MemoryReading
from qwen3_tts_engine.models.recipes import RECIPES

MAKE_BEFORE_BREAK = "make-before-break"
BREAK_BEFORE_MAKE = "break-before-make"
MODES = ("auto", MAKE_BEFORE_BREAK, BREAK_BEFORE_MAKE)

# Rough average bits per weight of the real 0.6B model per variant: only used to place a variant
# that is not on the configured ladder (the one the engine starts with) at its rung.
# Below 4bit, the rungs that also shrink the embeddings (and the vocoder).
NOMINAL_BITS = {"bf16": 16.0, "talker-mlp-w4": 12.0, "8bit": 8.5, "6bit": 6.5,
                "keep-code-predictor": 4.7, "4bit": 4.5, "4bit-emb8": 4.4, "4bit-emb4": 4.3,
                "4bit-temb4-cemb8-voc16": 4.2, "4bit-emb4-voc16": 4.1}  # fmt: skip


def nominal_bits(variant: str) -> float:
    if variant in NOMINAL_BITS:
        return NOMINAL_BITS[variant]
    recipe = RECIPES[variant]
    return recipe.default_bits + 0.5 if recipe.default_bits else 16.0


@dataclass(frozen=True)
class Policy:
    """The governor's settings; the defaults are the documented ones (docs/governor.md)."""

    # Largest first. Rungs without a passing quality report for the model are left off at start
    # (governor/gate.py), so the bottom rung is the smallest one that passed.
    ladder: tuple[str, ...] = ("bf16", "8bit", "4bit", "4bit-emb8", "4bit-temb4-cemb8-voc16",
                               "4bit-emb4-voc16")  # fmt: skip
    downgrade_at: float = 0.85  # used fraction of the memory limit
    upgrade_at: float = 0.65
    downgrade_hold_s: float = 3.0  # pressure must stay at/above downgrade_at this long
    upgrade_hold_s: float = 30.0  # ... and below upgrade_at this long
    cooldown_s: float = 20.0  # no swap this soon after the previous one was serving
    critical_at: float = 0.95  # at/above: step down at once (no hold, no cool-down)
    mode: str = "auto"  # or make-before-break / break-before-make
    make_before_break_below: float = 0.95  # auto: both workers must fit under this fraction

    def __post_init__(self) -> None:
        if not self.ladder or len(set(self.ladder)) != len(self.ladder):
            raise ValueError(f"the ladder needs distinct variants, got {self.ladder!r}")
        unknown = [v for v in self.ladder if v not in RECIPES]
        if unknown:
            raise ValueError(f"unknown variant(s) on the ladder: {', '.join(unknown)}; valid: "
                             f"{', '.join(RECIPES)}")  # fmt: skip
        if not 0 < self.upgrade_at < self.downgrade_at <= self.critical_at <= 1.5:
            raise ValueError("need 0 < upgrade_at < downgrade_at <= critical_at (fractions of "
                             f"the limit), got {self.upgrade_at}, {self.downgrade_at}, "
                             f"{self.critical_at}")  # fmt: skip
        if min(self.downgrade_hold_s, self.upgrade_hold_s, self.cooldown_s) < 0:
            raise ValueError("hold times and cool-down must be >= 0")
        if self.mode not in MODES:
            raise ValueError(f"unknown swap mode {self.mode!r}; one of {', '.join(MODES)}")


@dataclass(frozen=True)
class PolicyState:
    above_since: float | None = None  # start of an unbroken run of readings >= downgrade_at
    below_since: float | None = None  # start of an unbroken run of readings < upgrade_at
    last_swap_at: float | None = None  # when the last swap's new variant began serving
    note: str = ""  # why a pending move is not made (for the status endpoint)


@dataclass(frozen=True)
class Decision:
    target: str
    direction: str  # down | up
    cause: str  # pressure | critical | recovered (manual swaps use "manual")
    reason: str  # one human-readable line for the log and the swap history


def effective_ladder(ladder: Sequence[str], start: str) -> tuple[str, ...]:
    """The rungs the governor uses: the start variant (placed by precision when the ladder lacks
    it) and the rungs below it. It never climbs above the variant the engine started with."""
    rungs = list(ladder)
    if start not in rungs:
        bits = nominal_bits(start)
        at = next((i for i, v in enumerate(rungs) if nominal_bits(v) < bits), len(rungs))
        rungs.insert(at, start)
    return tuple(rungs[rungs.index(start) :])


def effective_pressure(policy: Policy, reading: MemoryReading) -> float:
    """The used fraction, raised to a watermark when the kernel itself reports pressure."""
    floor = {"warn": policy.downgrade_at, "critical": policy.critical_at}.get(
        reading.kernel_level or "", 0.0
    )
    return max(reading.pressure, floor)


def observe(policy: Policy, state: PolicyState, pressure: float, now: float) -> PolicyState:
    """Update the hold timers with one reading."""
    above = pressure >= policy.downgrade_at
    below = pressure < policy.upgrade_at
    return replace(
        state,
        above_since=(state.above_since if state.above_since is not None else now)
        if above
        else None,
        below_since=(state.below_since if state.below_since is not None else now)
        if below
        else None,
    )


def after_swap(state: PolicyState, now: float) -> PolicyState:
    """A swap just began serving: the cool-down starts, and readings from before no longer count."""
    return PolicyState(last_swap_at=now)


def predicted_pressure(reading: MemoryReading, current_fp: int, target_fp: int) -> float:
    """Pressure once `current` is replaced by `target` (both footprints in bytes)."""
    return (reading.used_bytes - current_fp + target_fp) / max(1, reading.limit_bytes)


def fits(reading: MemoryReading, current_fp: int | None, target_fp: int | None,
         policy: Policy) -> bool:  # fmt: skip
    """Would the larger variant stay below the downgrade watermark (so that it does not flap)?"""
    if current_fp is None or target_fp is None:
        return False  # unknown: do not risk it
    return predicted_pressure(reading, current_fp, target_fp) < policy.downgrade_at


def choose_mode(policy: Policy, reading: MemoryReading | None, target_fp: int | None) -> str:
    """Make before break when both workers fit at once, break before make otherwise."""
    if policy.mode != "auto":
        return policy.mode
    if reading is None or target_fp is None:
        return BREAK_BEFORE_MAKE
    peak = (reading.used_bytes + target_fp) / max(1, reading.limit_bytes)
    return MAKE_BEFORE_BREAK if peak <= policy.make_before_break_below else BREAK_BEFORE_MAKE


def decide(
    policy: Policy,
    state: PolicyState,
    reading: MemoryReading,
    current: str,
    footprints: Mapping[str, int | None],
    now: float,
) -> tuple[Decision | None, PolicyState]:
    """One step of the governor: observe `reading` at `now`, maybe move one rung.

    Down: pressure held at/above `downgrade_at` for `downgrade_hold_s`, outside the cool-down;
    at/above `critical_at` at once. Up: pressure held below `upgrade_at` for `upgrade_hold_s`,
    outside the cool-down, and the larger variant fits (from its footprint).
    """
    pressure = effective_pressure(policy, reading)
    state = replace(observe(policy, state, pressure, now), note="")
    ladder = policy.ladder
    if current not in ladder:
        return None, replace(state, note=f"{current} is not on the ladder (pinned by an operator?)")
    pos = ladder.index(current)
    cooling = state.last_swap_at is not None and now - state.last_swap_at < policy.cooldown_s
    where = f"{reading.source}{': ' + reading.detail if reading.detail else ''}"

    if pos + 1 < len(ladder) and pressure >= policy.downgrade_at:
        target = ladder[pos + 1]
        if pressure >= policy.critical_at:
            return Decision(target, "down", "critical",
                            f"pressure {pressure:.3f} >= critical {policy.critical_at} [{where}]"), state  # fmt: skip
        held = now - state.above_since
        if held >= policy.downgrade_hold_s and not cooling:
            return Decision(target, "down", "pressure",
                            f"pressure {pressure:.3f} >= {policy.downgrade_at} for {held:.1f}s "
                            f"[{where}]"), state  # fmt: skip
        note = "cooling down" if cooling else f"holding ({held:.1f}s of {policy.downgrade_hold_s}s)"
        return None, replace(state, note=f"down to {target}: {note}")

    if pos > 0 and pressure < policy.upgrade_at:
        target = ladder[pos - 1]
        held = now - state.below_since
        if held < policy.upgrade_hold_s or cooling:
            note = (
                "cooling down" if cooling else f"holding ({held:.1f}s of {policy.upgrade_hold_s}s)"
            )
            return None, replace(state, note=f"up to {target}: {note}")
        cur_fp, tgt_fp = footprints.get(current), footprints.get(target)
        if not fits(reading, cur_fp, tgt_fp, policy):
            after = "unknown" if cur_fp is None or tgt_fp is None else \
                f"{predicted_pressure(reading, cur_fp, tgt_fp):.3f}"  # fmt: skip
            return None, replace(state, note=f"up to {target}: would not fit (pressure after: "
                                              f"{after} >= {policy.downgrade_at})")  # fmt: skip
        return Decision(target, "up", "recovered",
                        f"pressure {pressure:.3f} < {policy.upgrade_at} for {held:.1f}s and "
                        f"{target} fits [{where}]"), state  # fmt: skip
    return None, state
