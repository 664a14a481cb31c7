"""Percentile-bootstrap confidence intervals for quality metrics: one metric over items, or a
candidate minus a baseline on the same items (paired). numpy only, deterministic per seed.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_CHUNK = 1 << 20  # resampled values per block: bounds memory for long inputs


def _floats(values: Iterable[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64).ravel()


def _boot_means(x: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n, step = len(x), max(1, _CHUNK // len(x))
    blocks = [x[rng.integers(0, n, (min(step, n_boot - i), n))].mean(axis=1)
              for i in range(0, n_boot, step)]  # fmt: skip
    return np.concatenate(blocks)


def _summary(x: np.ndarray, n_boot: int, alpha: float, seed: int) -> tuple[dict, np.ndarray]:
    if len(x) == 0:
        return {"mean": None, "ci": [None, None], "n": 0}, np.empty(0)
    mean = float(x.mean())
    if len(x) == 1:
        return {"mean": mean, "ci": [mean, mean], "n": 1}, np.full(1, mean)
    means = _boot_means(x, n_boot, seed)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return {"mean": mean, "ci": [float(lo), float(hi)], "n": len(x)}, means


def bootstrap_ci(
    values: Iterable[float | None], *, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict:
    """{"mean", "ci": [lo, hi], "n"}: the mean of `values` with a (1 - alpha) percentile
    bootstrap interval. None/NaN items are dropped (n counts the rest); empty -> mean None."""
    x = _floats(values)
    return _summary(x[~np.isnan(x)], n_boot, alpha, seed)[0]


def paired_bootstrap(
    candidate: Iterable[float | None],
    baseline: Iterable[float | None],
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    higher_is_better: bool = False,
) -> dict:
    """Mean of candidate - baseline per item, with a CI from resampling items (pairs stay
    together), and "p_worse": the fraction of bootstrap means on the worse side of 0 (> 0 for a
    lower-is-better metric, the default). Pairs with a None/NaN side are dropped."""
    c, b = _floats(candidate), _floats(baseline)
    if c.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {len(c)} vs {len(b)}")
    d = c - b  # NaN where either side is missing
    out, means = _summary(d[~np.isnan(d)], n_boot, alpha, seed)
    worse = means < 0 if higher_is_better else means > 0
    out["p_worse"] = float(worse.mean()) if len(means) else None
    return out
