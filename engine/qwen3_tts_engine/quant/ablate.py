"""`qwen3-tts ablate`: which component does quantization hurt, and which recipe fits a budget.

Stage 1: for each component, "only this quantized" and "all but this quantized" against the
reference (teacher-forced and free-running metrics). Components are ranked by the damage of
"only this" (codebook-0 KL + code-predictor KL). Stage 2: starting from everything quantized,
the most damaging components are kept at higher precision one at a time until the candidate
fits the budget; that recipe is proposed (the smallest of those tried that passes).

The treatment is round-to-nearest at `bits`, or, with `donor`, the modules of another checkpoint
(any quantized or modified copy of the reference) grafted into the reference. "Everything"
holds the embeddings only when the ablation names their components (the default names all).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.components import (
    COMPONENTS,
    EMBEDDING_COMPONENTS,
    all_but,
    check_components,
    only,
    protect,
)
from qwen3_tts_engine.models.recipes import recipe_to_dict
from qwen3_tts_engine.quant.candidates import Candidate
from qwen3_tts_engine.quant.evaluate import EvalSettings, Reference, evaluate
from qwen3_tts_engine.worker.loading import component_paths, quantizable_modules


def damage(entry: dict) -> float:
    m = entry["metrics"]
    return m["cb0_kl"]["mean"] + m["cp_kl"]["mean"]


def _embeddings(components: list[str]) -> list[str]:
    """The embedding components an ablation studies: "everything" holds them only if named."""
    return [c for c in components if c in EMBEDDING_COMPONENTS]


def _stage1(model, components: list[str], bits: int, group_size: int,
            donor: Path | None) -> list[Candidate]:  # fmt: skip
    emb = _embeddings(components)
    if donor is None:
        return [c for comp in components
                for c in (Candidate(f"only-{comp}", recipe=only(comp, bits, group_size)),
                          Candidate(f"all-but-{comp}", recipe=all_but(comp, bits, group_size, emb)))]  # fmt: skip
    left_out = {p for c in EMBEDDING_COMPONENTS if c not in emb for p in component_paths(model, c)}
    everything = {p for p, _ in quantizable_modules(model)} - left_out
    out = []
    for comp in components:
        mine = set(component_paths(model, comp))
        out += [Candidate(f"only-{comp}", "graft", path=donor, paths=tuple(sorted(mine))),
                Candidate(f"all-but-{comp}", "graft", path=donor, paths=tuple(sorted(everything - mine)))]  # fmt: skip
    return out


def ablate(
    reference_path: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    keep_bits: int | None = 8,
    donor: Path | None = None,
    components: list[str] | None = None,
    settings: EvalSettings | None = None,
    propose: bool = True,
    progress: Callable[[str], None] = logger.info,
) -> dict:
    """The ablation report: stage-1 candidates, the ranking, and (RTN only) the proposal."""
    settings = settings or EvalSettings()
    components = components or list(COMPONENTS)
    check_components(components)
    ref = Reference(reference_path, settings, progress=progress)
    report = evaluate(reference_path, _stage1(ref.model, components, bits, group_size, donor),
                      settings, progress=progress, reference=ref)  # fmt: skip
    by_name = {c["name"]: c for c in report["candidates"]}
    ranking = sorted(
        ({"component": comp, "description": COMPONENTS[comp][2],
          "damage_only": damage(by_name[f"only-{comp}"]),
          "damage_all_but": damage(by_name[f"all-but-{comp}"]),
          "only_passed": by_name[f"only-{comp}"]["passed"]} for comp in components),
        key=lambda r: (-r["damage_only"], r["damage_all_but"]),
    )  # fmt: skip
    report["ablation"] = {"bits": bits, "group_size": group_size, "keep_bits": keep_bits,
                          "treatment": f"graft from {donor}" if donor else f"round-to-nearest w{bits}g{group_size}",
                          "ranking": ranking, "proposal": None}  # fmt: skip
    progress("ranking (damage of 'only this' = cb0 KL + cp KL): " + ", ".join(
        f"{r['component']} {r['damage_only']:.4g}" for r in ranking))  # fmt: skip
    if propose and donor is None:
        report["ablation"]["proposal"] = _propose(
            ref, report, ranking, bits, group_size, keep_bits, progress
        )
    return report


def _propose(ref: Reference, report: dict, ranking: list[dict], bits: int, group_size: int,
             keep_bits: int | None, progress) -> dict:  # fmt: skip
    """Protect the most damaging components one by one until the candidate fits the budget."""
    tried = []
    for n in range(len(ranking) + 1):
        kept = [r["component"] for r in ranking[:n]]
        recipe = protect(
            kept, bits, group_size, keep_bits, _embeddings([r["component"] for r in ranking])
        )
        sub = evaluate(ref.path, [Candidate(recipe.name, recipe=recipe)], ref.settings,
                       progress=progress, reference=ref)["candidates"][0]  # fmt: skip
        report["candidates"].append(sub)
        tried.append(recipe.name)
        if sub["passed"]:
            return {"recipe": recipe_to_dict(recipe), "name": recipe.name, "kept": kept,
                    "size_ratio": sub["size_ratio"], "tried": tried}  # fmt: skip
    return {"recipe": None, "tried": tried,
            "note": "no recipe tried fits the budget, even with every component kept at "
                    f"{'bf16' if keep_bits is None else f'{keep_bits} bits'}"}  # fmt: skip
