"""The quality budget: what a stored quality report's metrics must meet for its variant to
serve. `quant` writes the reports (eval) against it; the governor's gate reads them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

SCHEMA = "qwen3-tts-quality/1"

# name -> (label, unit / what it measures, higher_is_better); the order is the chart order
METRICS: dict[str, tuple[str, str, bool]] = {
    "cb0_kl": ("codebook-0 KL", "nats/frame, talker vs reference distribution", False),
    "cb0_top1": ("codebook-0 top-1", "fraction of frames agreeing with reference argmax", True),
    "cp_kl": ("code-predictor KL", "nats/frame, mean over codebooks 1-15", False),
    "cp_top1": ("code-predictor top-1", "fraction agreeing with reference argmax", True),
    "eos_drift": (
        "EOS drift",
        "mean |Δ P(end of speech)| per step along the reference codes",
        False,
    ),
    "length_ratio": ("length ratio", "candidate / reference frames (ideal 1)", False),
    "runaway_rate": (
        "runaway rate",
        "fraction hitting the token cap where the reference stopped",
        False,
    ),
    "silence_rate": ("silence rate", "fraction of utterances Silero hears as silent", False),
    "first_divergence": ("first divergence", "first frame whose 16 codes differ (same seed)", True),
    "mrstft": ("MR-STFT distance", "spectral convergence + log-magnitude L1", False),
    "logmel": ("log-mel L1", "mean |Δ ln mel|, Slaney 80 bands", False),
    "cer": ("CER", "character error rate of the Whisper transcript", False),
}
# Defaults for real checkpoints; tiny random test checkpoints fail them (see docs/quantization.md: The gate).
DEFAULT_BUDGET = {
    "cb0_kl": {"max": 0.05},
    "cp_kl": {"max": 0.1},
    "cb0_top1": {"min": 0.9},
    "eos_drift": {"max": 0.02},
    "length_ratio": {"min": 0.8, "max": 1.25},
    "runaway_rate": {"max": 0.05},
}


def metric_mean(value) -> float | None:
    """The mean of a metric entry ({"mean", "ci", "n"} or a bare number); None if unusable."""
    m = value.get("mean") if isinstance(value, dict) else value
    return None if m is None or (isinstance(m, float) and math.isnan(m)) else float(m)


def evaluate_budget(metrics: dict, budget: dict) -> list[str]:
    """Failure messages for every budget entry ({"max": x} and/or {"min": x}) the metric means
    break; a budgeted metric without a usable mean fails as "name: not measured"."""
    failures = []
    for name, limits in budget.items():
        m = metric_mean(metrics.get(name))
        if m is None:
            failures.append(f"{name}: not measured")
            continue
        if "max" in limits and m > limits["max"]:
            failures.append(f"{name} {m:.3g} > max {limits['max']:.3g}")
        if "min" in limits and m < limits["min"]:
            failures.append(f"{name} {m:.3g} < min {limits['min']:.3g}")
    return failures


def load_budget(path: Path) -> dict:
    """A budget file (YAML or JSON): metric name -> {max: x} and/or {min: x}, checked."""
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read budget {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a budget maps metric names to {{max: x}} and/or {{min: x}}")
    for name, limits in data.items():
        if name not in METRICS:
            raise ValueError(f"{path}: unknown metric {name!r}; metrics: {', '.join(METRICS)}")
        if not isinstance(limits, dict) or not limits or set(limits) - {"min", "max"} or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in limits.values()
        ):  # fmt: skip
            raise ValueError(f"{path}: {name} needs {{max: number}} and/or {{min: number}}")
        if limits.get("min", float("-inf")) > limits.get("max", float("inf")):
            raise ValueError(f"{path}: {name} has min > max")
    return data
