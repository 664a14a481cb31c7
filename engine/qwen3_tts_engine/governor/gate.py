"""The quality gate of the governor's ladder: a quantized rung needs a stored passing report.

`qwen3-tts eval` stores one small verdict per (reference checkpoint, recipe) under
`$QWEN3_TTS_CACHE/reports/<model key>/<recipe>-<recipe digest>.json`. The key is the content
digest of a local checkpoint (so a changed checkpoint needs a new evaluation) or a hash of a hub
id. The governor accepts a quantized rung only with a passing verdict for exactly that recipe, or
with the operator's consent (`--allow-unevaluated`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from qwen3_tts_engine.governor.budget import evaluate_budget
from qwen3_tts_engine.models.checkpoints import cache_root, recipe_digest, source_digest
from qwen3_tts_engine.models.recipes import Recipe, get_recipe, recipe_from_dict
from qwen3_tts_engine.models.variants import resolve, resolve_model


def reports_root() -> Path:
    return cache_root() / "reports"


def model_key(model: str | Path) -> str:
    """What identifies the reference: a local checkpoint's content digest, or a hub id's hash."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return source_digest(path)[:16]
    try:
        name = resolve_model(str(model)).name  # Qwen/X and mlx-community/X are one model
    except ValueError:
        name = str(model)
    return "hub-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def verdict_path(model: str | Path, recipe: Recipe) -> Path:
    return reports_root() / model_key(model) / f"{recipe.name}-{recipe_digest(recipe)}.json"


def store(report: dict, report_json: Path, model: str | Path) -> list[Path]:
    """Store a verdict for every round-to-nearest candidate of `report` (what the engine loads)."""
    written = []
    for c in report["candidates"]:
        if c["method"] != "rtn" or not c.get("recipe"):
            continue
        recipe = recipe_from_dict(c["recipe"])
        verdict = {
            "model": str(model), "model_key": model_key(model), "recipe": recipe.name,
            "recipe_digest": recipe_digest(recipe), "passed": c["passed"], "failures": c["failures"],
            "metrics": {k: v["mean"] for k, v in c["metrics"].items()}, "budget": report["budget"],
            "size_ratio": c["size_ratio"], "report": str(report_json), "created": report["created"],
            "items": len(report["texts"]) * len(report["seeds"]),
        }  # fmt: skip
        path = verdict_path(model, recipe)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict, indent=2))
        written.append(path)
    return written


def lookup(model: str | Path, recipe: Recipe) -> dict | None:
    path = verdict_path(model, recipe)
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def verdict_failures(verdict: dict, budget: dict | None, min_items: int) -> list[str]:
    """Why a stored verdict does not pass here: its own failures, the engine's budget (which may
    be stricter than the one it was evaluated with), or too few evaluated items."""
    failures = list(verdict["failures"])
    if budget is not None:
        failures += [f for f in evaluate_budget(verdict["metrics"], budget) if f not in failures]
    if verdict.get("items", 0) < min_items:
        failures.append(f"evaluated on {verdict.get('items', 0)} items < {min_items} required")
    return failures


def check_rung(model: str | Path, variant: str, *, start: str | None = None,
               consent: frozenset[str] = frozenset(), budget: dict | None = None,
               min_items: int = 1) -> dict:  # fmt: skip
    """Whether the ladder may use `variant`, why, and the stored verdict if there is one."""
    recipe = get_recipe(variant)
    verdict = lookup(model, recipe) if recipe.is_quantized else None
    failures = verdict_failures(verdict, budget, min_items) if verdict is not None else None
    if not recipe.is_quantized:
        accepted, why = True, "full precision (the reference itself)"
    elif variant == start:
        accepted, why = True, "the variant the engine was started with (operator's choice)"
    elif verdict is not None and not failures:
        accepted, why = True, "stored passing report"
    elif "all" in consent or variant in consent:
        accepted, why = True, "operator consent (--allow-unevaluated)"
    elif verdict is not None:
        accepted, why = False, "stored report fails: " + "; ".join(failures)
    else:
        accepted, why = (
            False,
            f"no quality report (run: qwen3-tts eval --reference {model} --candidates {variant})",
        )
    check = {"variant": variant, "accepted": accepted, "why": why, "report": verdict}
    if verdict is not None and not Path(str(model)).expanduser().is_dir():
        if resolve(str(model), variant).quantize_with is None:
            check["note"] = ("the report measured round-to-nearest of the bf16 weights; this rung "
                             "loads the published repo, made the same way by mlx-audio's converter")  # fmt: skip
    return check
