"""The loop detector: a sentence whose codebook-0 codes stopped changing like speech is ended.

A talker that misses its end-of-speech either cycles (the same few frames again and again) or
holds one sound (silence, a hum) until the frame cap; mlx-audio's reference loop, like the
official code, runs such an utterance to `max_new_tokens`. The scheduler asks `loop_kind` after
every frame of a sentence with the sentence's codebook-0 codes (the talker's own tokens, so it
works without decoding audio); a hit ends the sentence as its cap would, and the stream's finish
reason becomes "repetition" (`SynthesisStats.finish_reason`). Pure: no model, no clock.

The two rules, over the last `window` frames of one sentence (docs/engine-api.md, "Loop
detector"):
- cycle: for some period p <= `max_period`, at least `min_match` of the window's codes equal the
  code p frames before (a held code is a cycle of period 1). Speech changes its codebook-0 code
  nearly every frame; a deterministic loop repeats it exactly.
- stall: once the text is all fed (always, in the "prompt" layout; dual-track after its
  `tts_eos`), the window holds at most `max_distinct` different codes: near-silence or a held
  sound, sampled, after there is nothing left to say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoopRules:
    window: int = 48  # frames (3.84 s at 12.5 Hz): no sentence of speech holds still this long
    max_period: int = 8  # the longest cycle looked for, in frames (640 ms)
    min_match: float = 0.9  # share of the window that repeats the code `period` frames back
    max_distinct: int = 3  # at most this many codes in the window, after the text: a stall

    def __post_init__(self) -> None:
        if not 1 <= self.max_period < self.window:
            raise ValueError("LoopRules: need 1 <= max_period < window")
        if not 0.0 < self.min_match <= 1.0 or self.max_distinct < 1:
            raise ValueError("LoopRules: need 0 < min_match <= 1 and max_distinct >= 1")

    @property
    def cycle_codes(self) -> int:
        """The most distinct codes a window that is a cycle can hold: its period's codes plus one
        per comparison allowed to miss. A window with more (any speech) skips the cycle test."""
        return max(p + (self.window - p) - math.ceil(self.min_match * (self.window - p) - 1e-9)
                   for p in range(1, self.max_period + 1))  # fmt: skip


def loop_kind(codes: Sequence[int], rules: LoopRules, *, text_fed: bool = True) -> str | None:
    """ "cycle" or "stall" when the last `rules.window` codes of a sentence (codebook 0, oldest
    first) loop, else None (also while fewer than a window's worth have been made)."""
    if len(codes) < rules.window:
        return None
    recent = codes[-rules.window :]
    distinct = len(set(recent))  # speech: most of the window; the cheap test runs every frame
    if distinct <= rules.cycle_codes:
        window = np.asarray(recent)
        for period in range(1, rules.max_period + 1):
            if np.mean(window[period:] == window[:-period]) >= rules.min_match - 1e-9:
                return "cycle"
    if text_fed and distinct <= rules.max_distinct:
        return "stall"
    return None


DEFAULT_LOOP_RULES = (
    LoopRules()
)  # what a worker runs with unless switched off (`--no-loop-detector`)
