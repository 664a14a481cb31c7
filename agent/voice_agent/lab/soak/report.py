"""The soak benchmark's numbers (`voice-agent bench soak`): pure functions over the turns, faults
and process samples it recorded, so that they are testable without servers.

Times are seconds since the run's start. A turn is a dict with `t_start`, `t_done`, `outcome`
("answer", "apology", "greeting" or "failed"), `cause` (failed turns), `first_audio_s` and
`voice_to_voice_s`; a fault is a dict with `name`, `t` (injected) and `t_recovered` (None: never).
"""

from __future__ import annotations

import statistics
from collections import Counter

HEARD = ("answer", "apology", "greeting")  # outcomes where the caller heard the agent
LATENCIES = ("first_audio_s", "voice_to_voice_s")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def latency_summary(turns: list[dict]) -> dict:
    """p50/p95 of each latency over the turns the agent answered, and how they ended."""
    out: dict = {"turns": len(turns), "heard": sum(t["outcome"] in HEARD for t in turns),
                 "failed": sum(t["outcome"] == "failed" for t in turns)}  # fmt: skip
    for column in LATENCIES:
        xs = [t[column] for t in turns if t["outcome"] in HEARD and t.get(column) is not None]
        out[column] = {
            "p50": statistics.median(xs) if xs else None,
            "p95": percentile(xs, 0.95),
            "n": len(xs),
        }
    return out


def turn_totals(turns: list[dict]) -> dict:
    outcomes = Counter(t["outcome"] for t in turns)
    return {"attempted": len(turns), "answered": sum(outcomes[o] for o in HEARD),
            "by_outcome": dict(outcomes),
            "failed_by_cause": dict(Counter(t["cause"] for t in turns if t["outcome"] == "failed"))}  # fmt: skip


def fault_window(fault: dict, run_end: float) -> tuple[float, float]:
    """[injected, recovered] (to the run's end when it never recovered)."""
    end = fault.get("t_recovered")
    return fault["t"], run_end if end is None else max(end, fault["t"])


def fault_phases(fault: dict, turns: list[dict], run_end: float, window: float) -> dict:
    """Latency before (`window` s up to the fault), during (until it recovered) and after (the
    `window` s that follow), by when each turn's caller finished speaking (or started)."""
    t0, t1 = fault_window(fault, run_end)

    def when(t: dict) -> float:
        return t["t_speech_end"] if t.get("t_speech_end") is not None else t["t_start"]

    return {
        "before": latency_summary([t for t in turns if t0 - window <= when(t) < t0]),
        "during": latency_summary([t for t in turns if t0 <= when(t) <= t1]),
        "after": latency_summary([t for t in turns if t1 < when(t) <= t1 + window]),
    }


def lost_turns(fault: dict, turns: list[dict], run_end: float) -> dict:
    """Failed turns in this fault's window: in flight when it struck, or begun while it lasted.

    A fault strikes when it is injected, except one that takes a while to land (`t_struck`: a
    livekit-server stopped with SIGTERM drains for up to 10 s and only then goes away): a turn
    begun in that moment and cut when it landed was in flight too."""
    t0, t1 = fault_window(fault, run_end)
    struck = max(t0, fault.get("t_struck") or t0)
    failed = [t for t in turns if t["outcome"] == "failed"]
    in_flight = [t for t in failed if t["t_start"] <= struck and t["t_done"] >= t0]
    later = [t for t in failed if t not in in_flight and t0 <= t["t_start"] <= t1]
    return {"in_flight": len(in_flight), "after_the_fault": len(later),
            "causes": dict(Counter(t["cause"] for t in in_flight + later))}  # fmt: skip


def struck_turns(fault: dict, turns: list[dict], slack: float = 0.001) -> int:
    """Turns in flight as the fault struck (`t_strike`, else `t`): begun before it, ended after
    it. 0: it struck an idle system. (`slack`: the turn log's times are rounded to ms.)"""
    t = fault.get("t_strike", fault["t"])
    return sum(x["t_start"] <= t + slack and x["t_done"] >= t - slack for x in turns)


def unexplained_failures(
    turns: list[dict], faults: list[dict], run_end: float, slack: float = 5.0
) -> list[dict]:
    """Failed turns that overlap no fault's window (widened by `slack` s): losses no fault caused."""
    windows = [fault_window(f, run_end) for f in faults]
    return [t for t in turns if t["outcome"] == "failed"
            and not any(t["t_start"] <= b + slack and t["t_done"] >= a - slack for a, b in windows)]  # fmt: skip


def slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, value) in value per minute."""
    if len(samples) < 2:
        return None
    ts, vs = [t for t, _ in samples], [v for _, v in samples]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / den


def rss_growth(
    samples: list[tuple[float, float]], *, since: float, min_span: float, warmup: float = 0.0
) -> dict:
    """RSS growth of one process from its first sample at or after `since` (and `warmup` s after
    its own first sample: loading models is not growth) to its last one. `long_lived`: those
    samples span at least `min_span` seconds (only then does growth count)."""
    if not samples:
        return {"long_lived": False}
    since = max(since, samples[0][0] + warmup)
    tail = [(t, v) for t, v in samples if t >= since]
    out = {"first_mb": round(samples[0][1] / 2**20, 1), "last_mb": round(samples[-1][1] / 2**20, 1),
           "peak_mb": round(max(v for _, v in samples) / 2**20, 1),
           "slope_mb_per_min": _round(slope_per_min([(t, v / 2**20) for t, v in tail]), 3),
           "long_lived": bool(tail) and tail[-1][0] - tail[0][0] >= min_span}  # fmt: skip
    if tail and tail[0][1] > 0:
        out["growth_pct"] = round(100.0 * (tail[-1][1] - tail[0][1]) / tail[0][1], 2)
        out["from_s"], out["to_s"] = round(tail[0][0], 1), round(tail[-1][0], 1)
    return out


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)
