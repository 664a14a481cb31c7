"""Bootstrap statistics, budget checks and the report files of the quantization-quality run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from qwen3_tts_engine.quant.report import (
    METRICS,
    SCHEMA,
    evaluate_budget,
    markdown_table,
    write_report,
)
from qwen3_tts_engine.quant.stats import bootstrap_ci, paired_bootstrap


def width(r: dict) -> float:
    return r["ci"][1] - r["ci"][0]


def test_bootstrap_ci_contains_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small, large = bootstrap_ci(rng.normal(1, 1, 20)), bootstrap_ci(rng.normal(1, 1, 500))
    for r in (small, large):
        assert r["ci"][0] < r["mean"] < r["ci"][1]
    assert (small["n"], large["n"]) == (20, 500)
    assert width(large) < width(small) / 3  # ~ 1/sqrt(n): expected ratio 5


def test_bootstrap_is_deterministic_per_seed_and_handles_edge_cases():
    values = np.random.default_rng(1).exponential(size=50)
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert bootstrap_ci(values, seed=3)["ci"] != bootstrap_ci(values, seed=4)["ci"]
    assert bootstrap_ci([2.5]) == {"mean": 2.5, "ci": [2.5, 2.5], "n": 1}
    assert bootstrap_ci([])["mean"] is None
    assert bootstrap_ci([1.0, None, float("nan"), 3.0])["n"] == 2  # missing items are dropped


def test_paired_bootstrap_detects_a_consistent_shift():
    rng = np.random.default_rng(2)
    baseline = rng.normal(0, 1, 40)  # items differ a lot from each other...
    candidate = baseline + 0.05 + rng.normal(0, 0.01, 40)  # ...but the shift is consistent
    paired = paired_bootstrap(candidate, baseline)
    assert paired["mean"] == pytest.approx(0.05, abs=0.01)
    assert paired["ci"][0] > 0 and paired["p_worse"] == 1.0
    # unpaired intervals overlap: only pairing sees the shift
    assert bootstrap_ci(candidate)["ci"][0] < bootstrap_ci(baseline)["ci"][1]
    assert paired_bootstrap(candidate, baseline, higher_is_better=True)["p_worse"] == 0.0
    same = paired_bootstrap(baseline + rng.normal(0, 0.01, 40), baseline)
    assert same["ci"][0] < 0 < same["ci"][1] and 0.05 < same["p_worse"] < 0.95
    assert paired_bootstrap(candidate, baseline, seed=7) == paired_bootstrap(
        candidate, baseline, seed=7
    )
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 2.0], [1.0])


def test_evaluate_budget():
    metrics = {"cb0_kl": {"mean": 0.31, "ci": [0.2, 0.4], "n": 9}, "cb0_top1": 0.82, "cer": None}
    budget = {"cb0_kl": {"max": 0.05}, "cb0_top1": {"min": 0.9}, "cer": {"max": 0.1},
              "mrstft": {"max": 1.0}}  # fmt: skip
    assert evaluate_budget(metrics, budget) == [
        "cb0_kl 0.31 > max 0.05",
        "cb0_top1 0.82 < min 0.9",
        "cer: not measured",
        "mrstft: not measured",
    ]
    assert evaluate_budget(metrics, {"cb0_kl": {"max": 0.5}, "cb0_top1": {"min": 0.5}}) == []


def stat(mean: float, half: float = 0.01, n: int = 12) -> dict:
    return {"mean": mean, "ci": [mean - half, mean + half], "n": n}


def synthetic_report() -> dict:
    budget = {"cb0_kl": {"max": 0.05}, "cer": {"max": 0.1}, "cb0_top1": {"min": 0.9}}
    candidates = []
    for name, method, bits, kl, top1, cer in [
        ("int8-rtn", "rtn", 8, 0.01, 0.97, 0.04),
        ("int4-gptq", "gptq", 4, 0.04, 0.91, None),  # CER not measured
        ("int3|rtn", "rtn", 3, 0.31, 0.71, 0.22),  # a "|" in the name must not break the table
    ]:
        metrics = {"cb0_kl": stat(kl), "cb0_top1": stat(top1), "mrstft": stat(kl * 10, 0.2)}
        if cer is not None:
            metrics["cer"] = stat(cer)
        failures = evaluate_budget(metrics, budget)
        candidates.append({
            "name": name, "method": method, "recipe": {"bits": bits, "group_size": 64},
            "weight_bytes": int(1.8e9 * bits / 16), "size_ratio": bits / 16, "metrics": metrics,
            "per_head": {"cp_kl": [kl * (1 + i / 15) for i in range(15)]},
            "passed": not failures, "failures": failures,
        })  # fmt: skip
    return {
        "schema": SCHEMA, "created": "2025-01-01T00:00:00+00:00",
        "reference": {"path": "/models/Qwen3-TTS-0.6B-bf16", "digest": "abcdef0123456789",
                      "recipe": "bf16", "weight_bytes": 1_800_000_000},
        "texts": ["Hello there.", "How are you?"], "seeds": [0, 1, 2], "budget": budget,
        "noise_floor": {"cb0_kl": stat(0.004, 0.002), "mrstft": stat(0.5, 0.1)},
        "candidates": candidates,
    }  # fmt: skip


def test_write_report_writes_json_markdown_and_png(tmp_path):
    report = synthetic_report()
    paths = write_report(report, tmp_path / "out")
    assert set(paths) == {"json", "md", "png"} and all(p.is_file() for p in paths.values())

    assert json.loads(paths["json"].read_text()) == report

    md = paths["md"].read_text()
    for c in report["candidates"]:
        assert c["name"].replace("|", "\\|") in md
    assert "✗ cer: not measured" in md  # int4-gptq fails on the missing metric
    assert "✗ cb0_kl 0.31 > max 0.05; cer 0.22 > max 0.1; cb0_top1 0.71 < min 0.9" in md
    assert md.count("✓") == 1 and "0.01 [0, 0.02]" in md and "–" in md
    assert "/models/Qwen3-TTS-0.6B-bf16" in md and "seeds: 0, 1, 2" in md
    assert "cb0_kl ≤ 0.05" in md and "cb0_kl 0.004 [0.002, 0.006]" in md  # budget, noise floor
    table = markdown_table(report)
    rows = table.splitlines()
    assert len(rows) == 2 + 3 and table in md
    assert len({r.replace("\\|", "").count("|") for r in rows}) == 1  # same column count

    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(paths["png"]) as img:
        assert img.width > 400 and img.height > 300
        assert len(np.unique(np.asarray(img.convert("L")))) > 10  # something was drawn


def test_metrics_table_order_and_directions():
    assert list(METRICS)[:2] == ["cb0_kl", "cb0_top1"] and len(METRICS) == 12
    assert METRICS["cb0_top1"][2] and not METRICS["cer"][2]
    report = synthetic_report()
    report["candidates"][0]["metrics"]["custom"] = 1.5  # unknown metrics go last
    header = markdown_table(report).splitlines()[0]
    assert header.index("cb0_kl ↓") < header.index("cb0_top1 ↑") < header.index("mrstft ↓")
    assert header.index("cer ↓") < header.index("custom") < header.index("passed")
