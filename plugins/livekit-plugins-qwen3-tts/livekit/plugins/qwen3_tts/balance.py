"""Which engine takes the next request: the plugin's choice among usable endpoints, as pure
functions over a snapshot of each one's load (no I/O, no clock; `endpoints.py` feeds them, with
each engine's free slots by `fleet.free_slots`).

`balanced`: an engine with room first (its estimated free slots > 0, or unknown), then power of
two choices by utilisation: two candidates drawn at random, the less used one taken, so that many
clients with the same view of the fleet do not all pick the same engine. `priority`: the first
in configured order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .models import Strategy


@dataclass(frozen=True)
class Candidate:
    order: int  # position in the configured (and resolved) order
    outstanding: int  # this client's requests in flight there
    free: int | None  # estimated free slots (fleet.free_slots); None: the engine reports no load
    slots: int | None = None  # streams it keeps in real time, as last reported


def utilisation(c: Candidate) -> float:
    """Used share of an engine's slots; an engine without a load report counts its slots as 1
    (least outstanding requests, as gRPC's least_request)."""
    if c.free is None or not c.slots:
        return float(c.outstanding)
    return (c.slots - c.free) / c.slots


def pick(candidates: Sequence[Candidate], strategy: Strategy, rng: random.Random) -> Candidate:
    if not candidates:
        raise ValueError("no candidate")
    if strategy == "priority":
        return min(candidates, key=lambda c: c.order)
    roomy = [c for c in candidates if c.free is None or c.free > 0]
    if roomy:
        pool = roomy
    else:  # every engine is full by its report: the least overcommitted (it may queue, or 429)
        most = max(c.free for c in candidates)
        pool = [c for c in candidates if c.free == most]
    pair = rng.sample(list(pool), min(2, len(pool)))  # in random order: ties go either way
    return min(pair, key=utilisation)
