"""What an evaluation compares against the reference, and how each candidate model is built.

Candidates are built in memory from the reference checkpoint (round to nearest or GPTQ, exactly
the weights `qwen3-tts quantize` would save), loaded from a checkpoint directory, or grafted:
the reference with some modules taken from another checkpoint (ablation of any candidate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx.utils import tree_flatten

from qwen3_tts_engine.models.recipes import Recipe, recipe_to_dict
from qwen3_tts_engine.quant.gptq import apply_gptq, get_module, set_module
from qwen3_tts_engine.worker.loading import (
    apply_recipe,
    component_paths,
    load_checkpoint,
    recipe_plan,
)

METHODS = ("reference", "rtn", "gptq", "checkpoint", "graft")


@dataclass(frozen=True)
class Candidate:
    name: str
    method: str = "rtn"
    recipe: Recipe | None = None  # rtn / gptq
    path: Path | None = None  # checkpoint, or the graft's donor
    gptq: tuple[str, ...] = ()  # components whose modules GPTQ quantizes (method gptq)
    paths: tuple[str, ...] = ()  # graft: module paths taken from the donor

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; methods: {', '.join(METHODS)}")
        if self.method in ("rtn", "gptq") and self.recipe is None:
            raise ValueError(f"candidate {self.name}: method {self.method} needs a recipe")
        if self.method in ("checkpoint", "graft") and self.path is None:
            raise ValueError(f"candidate {self.name}: method {self.method} needs a checkpoint path")

    def describe(self) -> dict:
        return {
            "name": self.name, "method": self.method,
            "recipe": recipe_to_dict(self.recipe) if self.recipe else None,
            "path": str(self.path) if self.path else None,
            "gptq": list(self.gptq), "grafted": list(self.paths),
        }  # fmt: skip


def load_dir(path: Path):
    """An mlx-audio model with its tokenizers, the speech-tokenizer encoder included (Base
    checkpoints evaluate with reference audio)."""
    return load_checkpoint(Path(path), keep_encoder=True)


def graft(model, donor, paths) -> None:
    """Replace `model`'s modules at `paths` by the donor's (same architecture)."""

    for p in paths:
        set_module(model, p, get_module(donor, p))


def weight_bytes(model) -> int:
    """Bytes of the weights a recipe can change: everything but the vocoder and speaker encoder."""

    return sum(v.nbytes for k, v in tree_flatten(model.parameters())
               if not k.startswith(("speech_tokenizer", "speaker_encoder")))  # fmt: skip


def build(
    candidate: Candidate,
    reference: Path,
    *,
    calibrate: Callable | None = None,
    donors: dict[Path, object] | None = None,
    progress: bool = False,
) -> tuple[object, dict]:
    """The candidate's model and details (plan, GPTQ statistics).

    `calibrate(model)` runs the calibration forward passes GPTQ records inputs from.
    """
    if candidate.method == "checkpoint":
        return load_dir(candidate.path), {}
    model = load_dir(reference)
    if candidate.method == "reference":
        return model, {}
    if candidate.method == "graft":
        donors = donors if donors is not None else {}
        if candidate.path not in donors:
            donors[candidate.path] = load_dir(candidate.path)
        graft(model, donors[candidate.path], candidate.paths)
        return model, {"grafted": len(candidate.paths)}
    details: dict = {}
    skip: frozenset[str] = frozenset()
    if candidate.method == "gptq":
        if calibrate is None:
            raise ValueError("GPTQ needs calibration data")
        plan = recipe_plan(model, candidate.recipe)
        paths = sorted({p for c in candidate.gptq for p in component_paths(model, c)} & set(plan))
        if not paths:
            raise ValueError(
                f"recipe {candidate.recipe.name} quantizes no module of {candidate.gptq}"
            )
        stats = []
        for bits, group in sorted({plan[p] for p in paths}):
            same = [p for p in paths if plan[p] == (bits, group)]
            stats += apply_gptq(
                model, same, calibrate, bits=bits, group_size=group, progress=progress
            )
        details["gptq"] = stats
        skip = frozenset(paths)
    details["plan"] = apply_recipe(model, candidate.recipe, skip=skip)
    return model, details
