"""Variant resolution table and recipe matching (pure functions, no weights)."""

import json

import pytest

from qwen3_tts_engine.models.recipes import RECIPES, get_recipe, quantization_plan
from qwen3_tts_engine.models.variants import resolve, resolve_model

MC = "mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice"


@pytest.mark.parametrize(
    ("name", "variant", "source", "effective", "quantize"),
    [
        # mlx-community name without a suffix: -6bit by default, -<variant> when given
        (MC, None, f"{MC}-6bit", "6bit", None),
        (MC, "8bit", f"{MC}-8bit", "8bit", None),
        (MC, "bf16", f"{MC}-bf16", "bf16", None),
        (MC, "4bit", f"{MC}-4bit", "4bit", None),
        # a mixed recipe has no published repo: bf16 quantized on load
        (MC, "talker-mlp-w4", f"{MC}-bf16", "talker-mlp-w4", "talker-mlp-w4"),
        # a name that already ends in a known suffix is used as is
        (f"{MC}-4bit", None, f"{MC}-4bit", "4bit", None),
        (f"{MC}-bf16", "bf16", f"{MC}-bf16", "bf16", None),
        # Qwen/ names map to the mlx-community conversion
        ("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", None, f"{MC}-6bit", "6bit", None),
        (
            "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
            "8bit",
            "mlx-community/Qwen3-TTS-12Hz-1.7B-Base-8bit",
            "8bit",
            None,
        ),
        # another hub repo holds full precision: quantized on load when a variant asks for it
        ("someone/my-qwen3-tts", None, "someone/my-qwen3-tts", "bf16", None),
        ("someone/my-qwen3-tts", "4bit", "someone/my-qwen3-tts", "4bit", "4bit"),
    ],
)
def test_hub_resolution(name, variant, source, effective, quantize):
    got = resolve_model(name, variant)
    assert got.source == source
    assert got.variant == effective
    assert (got.quantize_with.name if got.quantize_with else None) == quantize
    assert not got.local


def test_local_full_precision_dir_is_quantized_on_load():
    cfg = {"model_type": "qwen3_tts"}
    assert resolve_model("/ckpt", None, local_config=cfg).quantize_with is None
    assert resolve_model("/ckpt", "bf16", local_config=cfg).quantize_with is None
    for v in ("8bit", "6bit", "4bit", "talker-mlp-w4"):
        got = resolve_model("/ckpt", v, local_config=cfg)
        assert got.local and got.source == "/ckpt" and got.quantize_with is RECIPES[v]


def test_local_prequantized_dir_is_used_as_is():
    cfg = {"quantization": {"bits": 4, "group_size": 64}}
    got = resolve_model("/q", None, local_config=cfg)
    assert got.variant == "4bit" and got.quantize_with is None
    with pytest.raises(ValueError, match="already quantized"):
        resolve_model("/q", "8bit", local_config=cfg)


def test_unknown_variant_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        resolve_model(MC, "3bits")
    for v in ("bf16", "8bit", "6bit", "4bit", "talker-mlp-w4"):
        assert v in str(e.value)


def test_conflicting_suffix_and_variant():
    with pytest.raises(ValueError, match="conflicts"):
        resolve_model(f"{MC}-8bit", "4bit")


def test_resolve_reads_local_directories(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    got = resolve(str(tmp_path), "8bit")
    assert got.local and got.quantize_with is RECIPES["8bit"]
    with pytest.raises(FileNotFoundError):
        resolve(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve(str(empty))


def _talker_modules(n_layers: int):
    mods = []
    for i in range(n_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mods.append((f"talker.model.layers.{i}.self_attn.{proj}", 1024))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            mods.append((f"talker.model.layers.{i}.mlp.{proj}", 1024))
    mods += [
        ("talker.codec_head", 1024),
        ("talker.model.codec_embedding", 1024),
        ("talker.code_predictor.model.layers.0.mlp.up_proj", 1024),
        ("talker.text_projection.linear_fc1", 2048),
        ("odd.linear", 100),
    ]
    return mods


def test_talker_mlp_w4_covers_layers_2_to_23_of_28():
    plan = quantization_plan(get_recipe("talker-mlp-w4"), _talker_modules(28), 28)
    layers = sorted({int(p.split(".")[3]) for p in plan})
    assert layers == list(range(2, 24))
    assert all(".mlp." in p and bits == (4, 64) for p, bits in plan.items())
    assert len(plan) == 22 * 3


def test_uniform_and_keep_code_predictor_plans():
    mods = _talker_modules(4)
    plan8 = quantization_plan(get_recipe("8bit"), mods, 4)
    assert "talker.model.codec_embedding" not in plan8  # embeddings stay unquantized
    assert "odd.linear" not in plan8  # 100 is not a multiple of the group size
    assert set(b for b, _ in plan8.values()) == {8}
    keep = quantization_plan(get_recipe("keep-code-predictor"), mods, 4)
    assert keep["talker.code_predictor.model.layers.0.mlp.up_proj"] == (8, 64)
    assert keep["talker.model.layers.0.mlp.up_proj"] == (4, 64)
    assert quantization_plan(get_recipe("bf16"), mods, 4) == {}
