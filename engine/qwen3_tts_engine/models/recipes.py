"""Quantization recipes as data: module-path rules mapped to bits and group size.

A recipe is matched against a model's module paths by a pure function, so what gets quantized
(and at how many bits) is testable without loading weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

VALID_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs in "affine" mode
VALID_GROUP_SIZES = (32, 64, 128)
# The speech tokenizer ships in float32; a recipe may load its decoder (the vocoder) in 16 bits.
VOCODER_DTYPES = ("bfloat16", "float16")

# Never quantized: the vocoder and the speaker encoder are convolutions.
ALWAYS_SKIPPED = ("speech_tokenizer", "speaker_encoder")
# mlx-audio keeps the embeddings unquantized in every published checkpoint
# (Model.model_quant_predicate); here a recipe rule that matches them quantizes them
# (nn.QuantizedEmbedding, as mlx-lm does for token embeddings). `default_bits` never does.
EMBEDDINGS = ("text_embedding", "codec_embedding")
# The code predictor without its codebook embeddings (those belong to the codec-embedding part).
CODE_PREDICTOR = r"^talker\.code_predictor\.(?!model\.codec_embedding\.)"
TEXT_EMBEDDING = r"^talker\.model\.text_embedding$"
CODEC_EMBEDDINGS = r"^talker\.(model|code_predictor\.model)\.codec_embedding(\.\d+)?$"

_LAYER_RE = re.compile(r"^talker\.model\.layers\.(\d+)\.")


def is_embedding(path: str) -> bool:
    return any(e in path for e in EMBEDDINGS)


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
    """Rules are tried in order; the first match decides. Unmatched modules get `default_bits`
    (embeddings excepted). `vocoder_dtype` (None: as shipped, float32) casts the vocoder."""

    name: str
    default_bits: int | None
    default_group_size: int = 64
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    description: str = ""
    vocoder_dtype: str | None = None

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
        if self.default_bits is None or is_embedding(path):
            return None
        return (self.default_bits, self.default_group_size)


# The parts of Qwen3-TTS an ablation quantizes one at a time (`components.py` builds its
# recipes); a recipe file's rule may name one (`component:`).
_LAYER = r"^talker\.model\.layers\.\d+\."

# name -> (pattern, talker-layer range or None, description)
COMPONENTS: dict[str, tuple[str, tuple[int, int] | None, str]] = {
    "talker-attention": (
        _LAYER + r"self_attn\.",
        None,
        "q/k/v/o projections of every talker layer",
    ),
    "talker-mlp": (_LAYER + r"mlp\.", None, "gate/up/down projections of every talker layer"),
    "talker-first-layer": (_LAYER, (0, 0), "all projections of talker layer 0"),
    "talker-last-layer": (_LAYER, (-1, -1), "all projections of the last talker layer"),
    "codec-head": (r"^talker\.codec_head$", None, "the talker's codebook-0 head"),
    "text-projection": (r"^talker\.text_projection\.", None, "text-embedding projection MLP"),
    "code-predictor": (CODE_PREDICTOR, None, "the 15-head code predictor (not its embeddings)"),
    "text-embedding": (
        TEXT_EMBEDDING,
        None,
        "the 151936-token text embedding (~620 MB in bf16 of the 0.6B)",
    ),
    "codec-embedding": (
        CODEC_EMBEDDINGS,
        None,
        "the codebook embeddings of the talker and the code predictor",
    ),
}
EMBEDDING_COMPONENTS = ("text-embedding", "codec-embedding")


def component_rule(component: str, bits: int | None, group_size: int = 64) -> Rule:
    """The rule that quantizes the named ablation component (`COMPONENTS`) at `bits`."""
    try:
        pattern, layers, _ = COMPONENTS[component]
    except KeyError:
        raise ValueError(
            f"unknown component {component!r}; components: {', '.join(COMPONENTS)}"
        ) from None
    return Rule(pattern, bits, group_size, layers)


def quantization_plan(
    recipe: Recipe, modules: Iterable[tuple[str, int]], num_talker_layers: int
) -> dict[str, tuple[int, int]]:
    """Map each quantizable module path to (bits, group_size).

    `modules` yields (path, input_features) of every Linear/Embedding in the model (an
    embedding's input width is its embedding width: mlx packs each row); a module whose input
    width is not a multiple of its group size stays unquantized (mlx cannot pack it).
    """
    plan: dict[str, tuple[int, int]] = {}
    for path, in_features in modules:
        assigned = recipe.assign(path, num_talker_layers)
        if assigned is not None and in_features % assigned[1] == 0:
            plan[path] = assigned
    return plan


def _uniform(bits: int) -> Recipe:
    return Recipe(f"{bits}bit", bits, description=f"every Linear at {bits} bits (affine, group 64)")


def _with_embeddings(bits: int, text_bits: int, codec_bits: int, name: str) -> Recipe:
    both = (
        f"the text and codec embeddings at {text_bits} bits"
        if text_bits == codec_bits
        else f"the text embedding at {text_bits} bits, the codec embeddings at {codec_bits}"
    )
    return Recipe(name, bits, rules=(Rule(TEXT_EMBEDDING, text_bits), Rule(CODEC_EMBEDDINGS, codec_bits)),
                  description=f"every Linear at {bits} bits, {both}")  # fmt: skip


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
        rules=(Rule(CODE_PREDICTOR, 8),),
        description="everything at 4 bits except the code predictor at 8 bits",
    ),
    "4bit-emb8": _with_embeddings(4, 8, 8, "4bit-emb8"),
    "4bit-emb4": _with_embeddings(4, 4, 4, "4bit-emb4"),
    # The codec embeddings are small (~70 MB in bf16 of the 0.6B) and at 4 bits cost more
    # quality than the text embedding does (docs/quantization.md): 8 bits for them.
    "4bit-temb4-cemb8-voc16": replace(
        _with_embeddings(4, 4, 8, "4bit-temb4-cemb8-voc16"),
        vocoder_dtype="bfloat16",
        description="every Linear and the text embedding at 4 bits, the codec embeddings at 8, "
        "the vocoder in bfloat16 (not float32)",
    ),
    "4bit-emb4-voc16": replace(
        _with_embeddings(4, 4, 4, "4bit-emb4-voc16"),
        vocoder_dtype="bfloat16",
        description="every Linear and embedding at 4 bits, the vocoder in bfloat16 (not float32)",
    ),
}

UNIFORM_VARIANTS = ("bf16", "8bit", "6bit", "4bit")


def variant_names() -> list[str]:
    """The built-in variants and recipes a handler can load by name (a YAML file is also one)."""
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(
            f"unknown variant {name!r}; valid variants: {', '.join(RECIPES)}"
        ) from None


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as the JSON/YAML a recipe file holds (`recipe_from_dict` reads it back)."""
    return {
        "name": recipe.name, "description": recipe.description,
        "default_bits": recipe.default_bits, "default_group_size": recipe.default_group_size,
        "rules": [{"pattern": r.pattern, "bits": r.bits, "group_size": r.group_size,
                   **({"layers": list(r.layers)} if r.layers else {})} for r in recipe.rules],
        **({"vocoder_dtype": recipe.vocoder_dtype} if recipe.vocoder_dtype else {}),
    }  # fmt: skip


def _bits(value, where: str) -> int | None:
    if value is None or value in ("bf16", "none"):
        return None
    if type(value) is not int or value not in VALID_BITS:
        raise ValueError(
            f"{where}: bits must be one of {VALID_BITS} or null (full precision), got {value!r}"
        )
    return value


def _group(value, where: str) -> int:
    if type(value) is not int or value not in VALID_GROUP_SIZES:
        raise ValueError(f"{where}: group_size must be one of {VALID_GROUP_SIZES}, got {value!r}")
    return value


def recipe_from_dict(data: dict, *, default_name: str = "custom") -> Recipe:
    """A recipe from parsed JSON/YAML; every mistake is a ValueError naming the field.

    Rules take a regular expression over module paths (`pattern`) or a named ablation
    `component` (see `qwen3-tts ablate --help`), optional `layers: [first, last]` (talker layers,
    negative from the end), `bits` (null keeps full precision) and `group_size`. A rule that
    matches an embedding quantizes it; `default_bits` never does. `vocoder_dtype` (bfloat16 or
    float16) loads the speech tokenizer's decoder in 16 bits.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a recipe is a mapping, got {type(data).__name__}")
    unknown = set(data) - {"name", "description", "default_bits", "default_group_size", "rules",
                           "vocoder_dtype"}  # fmt: skip
    if unknown:
        raise ValueError(f"unknown recipe field(s): {', '.join(sorted(unknown))}")
    group = _group(data.get("default_group_size", 64), "default_group_size")
    rules = []
    for i, r in enumerate(data.get("rules") or []):
        where = f"rules[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{where}: a rule is a mapping")
        bad = set(r) - {"pattern", "component", "bits", "group_size", "layers"}
        if bad:
            raise ValueError(f"{where}: unknown field(s): {', '.join(sorted(bad))}")
        if ("pattern" in r) == ("component" in r):
            raise ValueError(f"{where}: give exactly one of `pattern` or `component`")
        if "bits" not in r:
            raise ValueError(f"{where}: `bits` is required (null keeps full precision)")
        bits, gs = _bits(r["bits"], where), _group(r.get("group_size", group), where)
        layers = r.get("layers")
        if layers is not None and (not isinstance(layers, list | tuple) or len(layers) != 2
                                   or not all(type(x) is int for x in layers)):  # fmt: skip
            raise ValueError(f"{where}: layers must be [first, last] (integers), got {layers!r}")
        if "component" in r:
            base = component_rule(r["component"], bits, gs)
            rules.append(Rule(base.pattern, bits, gs, tuple(layers) if layers else base.layers))
            continue
        try:
            re.compile(r["pattern"])
        except (re.error, TypeError) as e:
            raise ValueError(f"{where}: bad pattern {r['pattern']!r}: {e}") from None
        rules.append(Rule(r["pattern"], bits, gs, tuple(layers) if layers else None))
    name = data.get("name") or default_name
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
        raise ValueError(f"recipe name {name!r}: use letters, digits and . _ + -")
    vocoder = data.get("vocoder_dtype")
    if vocoder is not None and vocoder not in VOCODER_DTYPES:
        raise ValueError(f"vocoder_dtype must be one of {VOCODER_DTYPES} or null, got {vocoder!r}")
    return Recipe(name, _bits(data.get("default_bits"), "default_bits"), group, tuple(rules),
                  str(data.get("description", "")), vocoder)  # fmt: skip


def load_recipe(spec: str) -> Recipe:
    """A built-in recipe by name, or a recipe file (.json, .yaml, .yml)."""
    if spec in RECIPES:
        return RECIPES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"{spec!r} is neither a built-in recipe ({', '.join(RECIPES)}) nor a recipe file"
        )
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError
        raise ValueError(f"{path}: cannot parse recipe: {e}") from None
    try:
        return recipe_from_dict(data, default_name=path.stem)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
