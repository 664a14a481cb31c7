"""Quantization recipes as data: module-path rules mapped to bits and group size.

A recipe is matched against a model's module paths by a pure function, so what gets quantized
(and at how many bits) is testable without loading weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# mlx-audio keeps these unquantized in every published checkpoint (Model.model_quant_predicate).
ALWAYS_SKIPPED = ("codec_embedding", "text_embedding", "speech_tokenizer", "speaker_encoder")

_LAYER_RE = re.compile(r"^talker\.model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Rule:
    """One rule: modules whose path matches `pattern` get `bits` (None keeps them unquantized).

    `layers` optionally restricts the rule to talker layers [first, last]; negative values count
    from the end, so (2, -5) means layers 2..N-5, i.e. 2..23 of the 28-layer talker.
    """

    pattern: str
    bits: int | None
    group_size: int = 64
    layers: tuple[int, int] | None = None

    def matches(self, path: str, num_talker_layers: int) -> bool:
        if not re.search(self.pattern, path):
            return False
        if self.layers is None:
            return True
        m = _LAYER_RE.match(path)
        if m is None:
            return False
        first, last = (i if i >= 0 else num_talker_layers + i for i in self.layers)
        return first <= int(m.group(1)) <= last


@dataclass(frozen=True)
class Recipe:
    """Rules are tried in order; the first match decides. Unmatched modules get `default_bits`."""

    name: str
    default_bits: int | None
    default_group_size: int = 64
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    description: str = ""

    @property
    def is_quantized(self) -> bool:
        return self.default_bits is not None or any(r.bits is not None for r in self.rules)

    def assign(self, path: str, num_talker_layers: int) -> tuple[int, int] | None:
        """(bits, group_size) for one quantizable module, or None to keep it in full precision."""
        if any(s in path for s in ALWAYS_SKIPPED):
            return None
        for rule in self.rules:
            if rule.matches(path, num_talker_layers):
                return None if rule.bits is None else (rule.bits, rule.group_size)
        if self.default_bits is None:
            return None
        return (self.default_bits, self.default_group_size)


def quantization_plan(
    recipe: Recipe, modules: Iterable[tuple[str, int]], num_talker_layers: int
) -> dict[str, tuple[int, int]]:
    """Map each quantizable module path to (bits, group_size).

    `modules` yields (path, input_features) of every Linear/Embedding in the model; a module whose
    input width is not a multiple of its group size stays unquantized (mlx cannot pack it).
    """
    plan: dict[str, tuple[int, int]] = {}
    for path, in_features in modules:
        assigned = recipe.assign(path, num_talker_layers)
        if assigned is not None and in_features % assigned[1] == 0:
            plan[path] = assigned
    return plan


def _uniform(bits: int) -> Recipe:
    return Recipe(f"{bits}bit", bits, description=f"every Linear at {bits} bits (affine, group 64)")


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", None, description="no quantization"),
    "8bit": _uniform(8),
    "6bit": _uniform(6),
    "4bit": _uniform(4),
    "talker-mlp-w4": Recipe(
        "talker-mlp-w4",
        None,
        rules=(Rule(r"^talker\.model\.layers\.\d+\.mlp\.(gate|up|down)_proj$", 4, layers=(2, -5)),),
        description="only the talker's MLP projections in layers 2..N-5 at 4 bits, the rest bf16",
    ),
    "keep-code-predictor": Recipe(
        "keep-code-predictor",
        4,
        rules=(Rule(r"^talker\.code_predictor\.", 8),),
        description="everything at 4 bits except the code predictor at 8 bits",
    ),
}

UNIFORM_VARIANTS = ("bf16", "8bit", "6bit", "4bit")


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(
            f"unknown variant {name!r}; valid variants: {', '.join(RECIPES)}"
        ) from None
