"""Recipe files (JSON/YAML), ablation components as recipes, and their plans (no weights)."""

from __future__ import annotations

import json

import pytest

from qwen3_tts_engine.models.components import (
    COMPONENTS,
    all_but,
    everything,
    only,
    protect,
)
from qwen3_tts_engine.models.recipes import (
    RECIPES,
    component_rule,
    load_recipe,
    quantization_plan,
    recipe_from_dict,
    recipe_to_dict,
)

N_LAYERS = 4
PATHS = [
    *(f"talker.model.layers.{i}.{kind}" for i in range(N_LAYERS) for kind in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")),
    "talker.codec_head", "talker.text_projection.linear_fc1", "talker.text_projection.linear_fc2",
    "talker.code_predictor.model.layers.0.mlp.up_proj", "talker.code_predictor.lm_head.0",
    "talker.code_predictor.lm_head.14", "talker.model.codec_embedding",
    "talker.model.text_embedding", "talker.code_predictor.model.codec_embedding.0",
    "talker.code_predictor.model.codec_embedding.14",
]  # fmt: skip
EMBEDDINGS = {p for p in PATHS if "embedding" in p}
MODULES = [(p, 128) for p in PATHS]


def plan(recipe):
    return quantization_plan(recipe, MODULES, N_LAYERS)


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_only_and_all_but_partition_the_quantizable_modules(component):
    every = set(plan(everything(4)))
    mine, rest = set(plan(only(component, 4))), set(plan(all_but(component, 4)))
    assert mine and rest, component
    assert mine | rest == every == set(PATHS) and not mine & rest


def test_embeddings_are_quantized_only_by_rules_that_name_them():
    assert not EMBEDDINGS & set(plan(RECIPES["4bit"]))  # default bits never reach them
    assert not EMBEDDINGS & set(plan(RECIPES["keep-code-predictor"]))
    assert not EMBEDDINGS & set(plan(only("code-predictor", 4)))
    assert set(plan(only("text-embedding", 4))) == {"talker.model.text_embedding"}
    assert set(plan(only("codec-embedding", 4))) == EMBEDDINGS - {"talker.model.text_embedding"}
    emb8, emb4 = plan(RECIPES["4bit-emb8"]), plan(RECIPES["4bit-emb4"])
    assert set(emb8) == set(emb4) == set(PATHS)
    assert {emb8[p] for p in EMBEDDINGS} == {(8, 64)} and {emb4[p] for p in EMBEDDINGS} == {(4, 64)}
    assert {emb8[p] for p in set(PATHS) - EMBEDDINGS} == {(4, 64)}
    # a recipe file names them as components
    r = recipe_from_dict({"default_bits": 4, "rules": [{"component": "text-embedding", "bits": 6}]})
    assert plan(r)["talker.model.text_embedding"] == (6, 64)
    assert "talker.model.codec_embedding" not in plan(r)


def test_components_select_the_modules_they_name():
    assert set(plan(only("talker-first-layer", 4))) == {
        p for p in PATHS if ".layers.0." in p and "code_predictor" not in p
    }
    assert set(plan(only("talker-last-layer", 4))) == {
        p for p in PATHS if ".layers.3." in p and "code_predictor" not in p
    }
    assert set(plan(only("codec-head", 4))) == {"talker.codec_head"}
    assert all(p.startswith("talker.code_predictor.") for p in plan(only("code-predictor", 4)))
    assert all(".mlp." in p for p in plan(only("talker-mlp", 4)))


def test_protect_keeps_components_at_higher_precision():
    p = plan(protect(["code-predictor", "codec-head"], 4, 64, 8))
    assert p["talker.codec_head"] == (8, 64) and p["talker.code_predictor.lm_head.14"] == (8, 64)
    assert p["talker.model.layers.1.mlp.gate_proj"] == (4, 64)
    p = plan(protect(["codec-head"], 4, 32, None))
    assert "talker.codec_head" not in p and p["talker.model.layers.0.self_attn.q_proj"] == (4, 32)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_recipe_file_round_trip_with_group_sizes(tmp_path, suffix):
    data = {
        "name": "mine", "default_bits": 4, "default_group_size": 32,
        "rules": [
            {"component": "code-predictor", "bits": 8, "group_size": 128},
            {"pattern": r"^talker\.model\.layers\.\d+\.mlp\.", "layers": [1, -2], "bits": 6},
            {"pattern": r"^talker\.codec_head$", "bits": None},
        ],
    }  # fmt: skip
    path = tmp_path / f"mine{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(str(path))
    p = plan(recipe)
    assert p["talker.code_predictor.lm_head.0"] == (8, 128)
    assert p["talker.model.layers.1.mlp.gate_proj"] == (6, 32)
    assert p["talker.model.layers.2.mlp.down_proj"] == (6, 32)
    assert p["talker.model.layers.3.mlp.down_proj"] == (4, 32)  # outside layers 1..N-2
    assert "talker.codec_head" not in p
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe


@pytest.mark.parametrize(
    "data, message",
    [
        ({"default_bits": 7}, "bits must be one of"),
        ({"default_bits": 4, "default_group_size": 48}, "group_size must be one of"),
        ({"default_bits": 4, "rules": [{"pattern": "(", "bits": 8}]}, "bad pattern"),
        ({"default_bits": 4, "rules": [{"component": "decoder", "bits": 8}]}, "unknown component"),
        ({"default_bits": 4, "rules": [{"pattern": "x"}]}, "`bits` is required"),
        (
            {"default_bits": 4, "rules": [{"pattern": "x", "component": "codec-head", "bits": 8}]},
            "exactly one",
        ),
        (
            {"default_bits": 4, "rules": [{"pattern": "x", "bits": 8, "layers": [1]}]},
            "layers must be",
        ),
        ({"default_bits": 4, "rules": [{"pattern": "x", "bits": 8, "bitz": 3}]}, "unknown field"),
        ({"default_bits": 4, "bits": 4}, "unknown recipe field"),
        ({"name": "../etc", "default_bits": 4}, "recipe name"),
        ([1, 2], "a recipe is a mapping"),
    ],
)
def test_bad_recipes_are_rejected_with_the_field_named(data, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict(data)


def test_load_recipe_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in recipe"):
        load_recipe("no-such-recipe")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [unclosed")
    with pytest.raises(ValueError, match="cannot parse recipe"):
        load_recipe(str(bad))
    assert load_recipe("talker-mlp-w4") is RECIPES["talker-mlp-w4"]
    with pytest.raises(ValueError, match="unknown component"):
        component_rule("nothing", 4)


def test_an_ablation_of_linear_components_leaves_the_embeddings_out():
    linear = set(PATHS) - EMBEDDINGS
    assert set(plan(all_but("codec-head", 4, embeddings=()))) == linear - {"talker.codec_head"}
    assert set(plan(protect(["codec-head"], 4, 64, 8, embeddings=()))) == linear
    assert set(plan(all_but("codec-head", 4, embeddings=("text-embedding",)))) == (
        linear - {"talker.codec_head"}
    ) | {"talker.model.text_embedding"}
