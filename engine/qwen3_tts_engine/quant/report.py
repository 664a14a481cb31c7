"""Quantization quality reports: budget checks, and the JSON / Markdown / PNG a run writes.

Schema "qwen3-tts-quality/1": a bf16 reference, candidates with bootstrap metrics, a budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from qwen3_tts_engine.governor.budget import METRICS, SCHEMA, evaluate_budget
from qwen3_tts_engine.governor.budget import metric_mean as _mean

__all__ = ["METRICS", "SCHEMA", "evaluate_budget"]

DASH = "–"


def metric_names(report: dict) -> list[str]:
    """Metrics with a value in some candidate or in the budget: METRICS order, unknown last."""
    seen = {k for c in report.get("candidates", []) for k, v in (c.get("metrics") or {}).items()
            if _mean(v) is not None} | set(report.get("budget") or {})  # fmt: skip
    return [m for m in METRICS if m in seen] + sorted(seen - set(METRICS))


def _fmt(value) -> str:
    m = _mean(value)
    if m is None:
        return DASH
    ci = value.get("ci") if isinstance(value, dict) else None
    if not ci or None in ci:
        return f"{m:.3g}"
    return f"{m:.3g} [{ci[0]:.3g}, {ci[1]:.3g}]"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _mb(n: int | None) -> str:
    return DASH if n is None else f"{n / 1e6:.1f}"


def markdown_table(report: dict) -> str:
    """One row per candidate: name, method, size, each metric as "mean [lo, hi]", pass/fail."""
    names = metric_names(report)
    arrows = {True: " ↑", False: " ↓"}
    head = ["candidate", "method", "size MB (ratio)"]
    head += [m + arrows[METRICS[m][2]] if m in METRICS else m for m in names] + ["passed"]
    rows = [head, ["---"] * len(head)]
    for c in report.get("candidates", []):
        ratio = c.get("size_ratio")
        size = _mb(c.get("weight_bytes")) + (f" ({ratio:.2f}×)" if ratio is not None else "")
        passed = "✓" if c.get("passed") else "✗ " + "; ".join(c.get("failures") or [])
        metrics = c.get("metrics") or {}
        rows.append([c.get("name", "?"), c.get("method", DASH), size]
                    + [_fmt(metrics.get(m)) for m in names] + [passed])  # fmt: skip
    return "\n".join("| " + " | ".join(_cell(x) for x in r) + " |" for r in rows)


def _markdown(report: dict) -> str:
    ref = report.get("reference") or {}
    budget = report.get("budget") or {}
    limits = [f"{m} {'≤' if k == 'max' else '≥'} {v:.3g}"
              for m, lim in budget.items() for k, v in lim.items()]  # fmt: skip
    floor = [f"{m} {_fmt(v)}" for m, v in (report.get("noise_floor") or {}).items()]
    lines = [
        "# Qwen3-TTS quantization quality",
        "",
        f"- Created: {report.get('created', DASH)}",
        f"- Reference: `{ref.get('path', DASH)}` ({ref.get('recipe', 'bf16')}, "
        f"{_mb(ref.get('weight_bytes'))} MB, digest `{str(ref.get('digest', DASH))[:12]}`)",
        f"- Texts: {len(report.get('texts') or [])}; seeds: "
        + (", ".join(map(str, report.get("seeds") or [])) or DASH),
        f"- Budget: {', '.join(limits) or 'none'}",
        f"- Noise floor (reference vs itself): {', '.join(floor) or 'not measured'}",
        "",
        "Metrics are means with 95 % bootstrap intervals; ↓ lower is better, ↑ higher.",
        "",
        markdown_table(report),
    ]
    heads = [(c["name"], c["per_head"]["cp_kl"]) for c in report.get("candidates", [])
             if (c.get("per_head") or {}).get("cp_kl")]  # fmt: skip
    if heads:
        n = max(len(v) for _, v in heads)
        lines += ["", "## Code-predictor KL per codebook", "",
                  "| candidate | " + " | ".join(str(i + 1) for i in range(n)) + " |",
                  "| --- " * (n + 1) + "|"]  # fmt: skip
        lines += [f"| {_cell(name)} | " + " | ".join(f"{v:.3g}" for v in vals) + " |"
                  for name, vals in heads]  # fmt: skip
    ablation = report.get("ablation")
    if ablation:
        lines += ["", f"## Ablation ({ablation['treatment']})", "",
                  "Damage = codebook-0 KL + code-predictor KL of the candidate.", "",
                  "| rank | component | damage, only this | damage, all but this |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {i} | {r['component']} | {r['damage_only']:.4g} | {r['damage_all_but']:.4g} |"
                  for i, r in enumerate(ablation["ranking"], 1)]  # fmt: skip
        proposal = ablation.get("proposal")
        if proposal and proposal.get("recipe"):
            lines += ["", f"Proposed recipe: `{proposal['name']}` (size ratio "
                      f"{proposal['size_ratio']:.3f}; tried {', '.join(proposal['tried'])})."]  # fmt: skip
        elif proposal:
            lines += ["", f"No proposal: {proposal.get('note')}"]
    pairs = [c for c in report.get("candidates", []) if c.get("vs_rtn")]
    if pairs:
        lines += ["", "## GPTQ vs round-to-nearest (same recipe, paired over items)", "",
                  "| candidate | metric | GPTQ − RTN [95 % CI] | relative | verdict |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for c in pairs:
            for metric, d in c["vs_rtn"].items():
                lines.append(f"| {_cell(c['name'])} | {metric} | {_fmt(d)} | "
                             f"{d['relative']:+.1%} | {d['verdict']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path) -> None:
    """One panel per metric: x = weights in MB, y = mean with its CI, one labelled point per
    candidate; noise floor dashed, budget dotted, reference size a grey vertical line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    names = [m for m in metric_names(report)
             if any(_mean((c.get("metrics") or {}).get(m)) is not None
                    for c in report.get("candidates", []))]  # fmt: skip
    cols = min(3, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    ref_bytes = (report.get("reference") or {}).get("weight_bytes")
    for ax, m in zip(axes, names, strict=False):
        label, unit, higher = METRICS.get(m, (m, "", False))
        for c in report.get("candidates", []):
            v = (c.get("metrics") or {}).get(m)
            y, x = _mean(v), c.get("weight_bytes")
            if y is None or x is None:
                continue
            ci = v.get("ci") if isinstance(v, dict) else None
            err = ([[max(0, y - ci[0])], [max(0, ci[1] - y)]]
                   if ci and None not in ci else None)  # fmt: skip
            color = "tab:green" if c.get("passed") else "tab:red"
            ax.errorbar(x / 1e6, y, yerr=err, fmt="o", color=color, capsize=3)
            ax.annotate(c.get("name", "?"), (x / 1e6, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)  # fmt: skip
        floor = _mean((report.get("noise_floor") or {}).get(m))
        if floor is not None:
            ax.axhline(floor, ls="--", color="tab:blue", lw=1, label="noise floor")
        for k, v in ((report.get("budget") or {}).get(m) or {}).items():
            ax.axhline(v, ls=":", color="tab:red", lw=1, label=f"budget {k}")
        if ref_bytes:
            ax.axvline(ref_bytes / 1e6, color="0.7", lw=1, label="bf16 reference")
        ax.set_title(f"{label} ({'↑' if higher else '↓'} better)", fontsize=9)
        ax.set_xlabel("weights (MB)", fontsize=8)
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in axes[len(names) :]:
        ax.set_axis_off()
    if not names:
        axes[0].text(0.5, 0.5, "no metrics measured", ha="center", va="center")
    fig.suptitle("Qwen3-TTS quantization quality (green: within budget, red: failed)", fontsize=10)
    fig.savefig(path, dpi=110)


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    """Write report.json, report.md and report.png into `out_dir`; returns {"json", "md", "png"}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"report.{k}" for k in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n")
    paths["md"].write_text(_markdown(report))
    plot_report(report, paths["png"])
    return paths
