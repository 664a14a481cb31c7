"""Sample-exact failover: after a failure the next endpoint makes the utterance again from its
start (same text, same seed), and the bytes the listener already heard are not played again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class PlaybackReport(Protocol):
    delivered_bytes: int  # played so far, over every endpoint tried
    skipped_bytes: int  # made again after a failover but not played again
    first_audio_s: float | None


def play_unheard(report: PlaybackReport, data: bytes, received: int, t0: float,
                 deliver: Callable[[bytes], None]) -> None:  # fmt: skip
    """Deliver the part of `data` not yet played. `received`: this attempt's bytes before `data`;
    `t0`: the clock reading the first audio's time is counted from."""
    skip = min(len(data), max(0, report.delivered_bytes - received))
    report.skipped_bytes += skip
    if skip < len(data):
        if report.first_audio_s is None:
            report.first_audio_s = time.perf_counter() - t0
        deliver(data[skip:])
        report.delivered_bytes += len(data) - skip
