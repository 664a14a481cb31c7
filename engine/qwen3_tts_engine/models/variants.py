"""Model-name resolution: which checkpoint to load for a model name and a variant.

The rules follow Hugging Face speech-to-speech's Qwen3-TTS handler; `resolve_model` is pure
(the caller passes a local directory's config), so every rule has a table test.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qwen3_tts_engine.models.recipes import RECIPES, UNIFORM_VARIANTS, Recipe, get_recipe

DEFAULT_VARIANT = "6bit"
MLX_COMMUNITY = "mlx-community/"
# Suffixes mlx-community uses for its Qwen3-TTS conversions.
KNOWN_SUFFIXES = ("bf16", "fp16", "8bit", "6bit", "5bit", "4bit", "3bit")
_SUFFIX_RE = re.compile(r"-(" + "|".join(KNOWN_SUFFIXES) + r")$")


@dataclass(frozen=True)
class ModelSource:
    """What to load: `source` (hub id or local path), and whether to quantize it on load."""

    name: str
    source: str
    variant: str
    local: bool
    quantize_with: Recipe | None = None


def _validate_variant(variant: str | None) -> None:
    if variant is not None:
        get_recipe(variant)  # raises ValueError listing the valid variants


def resolve_model(
    name: str, variant: str | None = None, *, local_config: dict | None = None
) -> ModelSource:
    """Resolve `name` (hub id or local directory) and `variant` to a ModelSource.

    `local_config` is the parsed config.json when `name` is an existing local directory.
    """
    if not name or not name.strip():
        raise ValueError("model name is empty")
    _validate_variant(variant)

    if local_config is not None:
        quant = local_config.get("quantization") or local_config.get("quantization_config")
        if quant:
            # A checkpoint `qwen3-tts quantize` wrote from a built-in recipe carries its name.
            recipe = local_config.get("qwen3_tts_recipe")
            found = recipe if recipe in RECIPES else f"{quant.get('bits')}bit"
            if variant is not None and variant != found:
                raise ValueError(
                    f"{name} is already quantized ({found}); variant {variant!r} needs a "
                    "full-precision directory"
                )
            return ModelSource(name, name, variant or found, local=True)
        if variant is None or not get_recipe(variant).is_quantized:
            return ModelSource(name, name, variant or "bf16", local=True)
        return ModelSource(name, name, variant, local=True, quantize_with=get_recipe(variant))

    if name.startswith("Qwen/"):
        name = MLX_COMMUNITY + name.removeprefix("Qwen/")

    suffix = _SUFFIX_RE.search(name)
    if suffix:
        found = suffix.group(1)
        if variant is not None and variant != found:
            raise ValueError(f"{name} names variant {found!r}, which conflicts with {variant!r}")
        return ModelSource(name, name, found, local=False)

    if name.startswith(MLX_COMMUNITY):
        chosen = variant or DEFAULT_VARIANT
        if chosen in UNIFORM_VARIANTS:
            return ModelSource(name, f"{name}-{chosen}", chosen, local=False)
        # Mixed recipes have no published repo: start from bf16 and quantize on load.
        return ModelSource(name, f"{name}-bf16", chosen, local=False, quantize_with=RECIPES[chosen])

    # Any other hub repo is taken to hold full-precision weights.
    if variant is None or not get_recipe(variant).is_quantized:
        return ModelSource(name, name, variant or "bf16", local=False)
    return ModelSource(name, name, variant, local=False, quantize_with=get_recipe(variant))


def resolve(name: str, variant: str | None = None) -> ModelSource:
    """`resolve_model` for a name that may be a local directory (reads its config.json)."""
    path = Path(name).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path} is a directory without config.json: not a checkpoint")
        config = json.loads(config_path.read_text())
        return resolve_model(str(path.resolve()), variant, local_config=config)
    if name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {name} does not exist")
    return resolve_model(name, variant)
