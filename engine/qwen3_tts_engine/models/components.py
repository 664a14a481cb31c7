"""The parts of Qwen3-TTS an ablation quantizes one at a time, as recipe rules over module paths.

Components may overlap (the first talker layer holds attention and MLP modules too); each one is
a set of quantizable Linear or Embedding paths, so "only this" and "all but this" are plain
recipes. "Everything" includes the embeddings, which a recipe's default bits never reach.
"""

from __future__ import annotations

from collections.abc import Collection

from qwen3_tts_engine.models.recipes import (
    COMPONENTS,
    EMBEDDING_COMPONENTS,
    Recipe,
    Rule,
    component_rule,
)

__all__ = [
    "COMPONENTS",
    "EMBEDDING_COMPONENTS",
    "all_but",
    "check_components",
    "everything",
    "only",
    "protect",
]


def check_components(names: Collection[str]) -> None:
    """ValueError naming any of `names` that is not a component."""
    if unknown := [c for c in names if c not in COMPONENTS]:
        raise ValueError(
            f"unknown component(s) {', '.join(unknown)}; components: {', '.join(COMPONENTS)}"
        )


def only(component: str, bits: int, group_size: int = 64) -> Recipe:
    """Only `component` quantized, everything else in full precision."""
    return Recipe(f"only-{component}-w{bits}g{group_size}", None, group_size,
                  (component_rule(component, bits, group_size),),
                  f"only {component} at {bits} bits")  # fmt: skip


def _embeddings(bits: int, group_size: int, but: list[str],
                among: Collection[str] = EMBEDDING_COMPONENTS) -> tuple[Rule, ...]:  # fmt: skip
    """Rules that put the embeddings `among` (except `but`) at `bits`: default bits never reach
    them."""
    return tuple(
        component_rule(c, bits, group_size)
        for c in EMBEDDING_COMPONENTS
        if c in among and c not in but
    )


def everything(bits: int, group_size: int = 64) -> Recipe:
    """Every quantizable module, embeddings included, at `bits`."""
    return Recipe(f"all-w{bits}g{group_size}", bits, group_size, _embeddings(bits, group_size, []),
                  f"everything (embeddings too) at {bits} bits")  # fmt: skip


def all_but(component: str, bits: int, group_size: int = 64,
            embeddings: Collection[str] = EMBEDDING_COMPONENTS) -> Recipe:  # fmt: skip
    """Everything quantized except `component`; "everything" holds the `embeddings` named (an
    ablation of the Linear components alone leaves the embeddings out, as before they existed)."""
    return Recipe(f"all-but-{component}-w{bits}g{group_size}", bits, group_size,
                  (component_rule(component, None), *_embeddings(bits, group_size, [component], embeddings)),
                  f"all but {component} at {bits} bits")  # fmt: skip


def protect(components: list[str], bits: int, group_size: int, keep_bits: int | None,
            embeddings: Collection[str] = EMBEDDING_COMPONENTS) -> Recipe:  # fmt: skip
    """All (with the `embeddings` named) at `bits` except `components`, which stay at
    `keep_bits` (None: full precision)."""
    keep = "bf16" if keep_bits is None else f"w{keep_bits}"
    name = f"w{bits}g{group_size}" + "".join(f"+{c}-{keep}" for c in components)
    rules = tuple(component_rule(c, keep_bits, group_size) for c in components)
    return Recipe(name, bits, group_size, rules + _embeddings(bits, group_size, components, embeddings),
                  f"all at {bits} bits; {', '.join(components) or 'nothing'} at {keep}")  # fmt: skip
