"""Quantize-on-load of a full-precision checkpoint, per variant and recipe, and its disk cache."""

import json
from pathlib import Path

import mlx.nn as nn
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.worker.loading import load, quantized_modules
from qwen3_tts_engine.worker.synthesis import stream_chunks

LAYERS = 8  # talker layers; talker-mlp-w4 then covers layers 2..N-5 = 2..3


@pytest.fixture(scope="module")
def source(tiny_checkpoint) -> Path:
    return tiny_checkpoint("custom_voice", talker_layers=LAYERS)


def _linear_paths(model) -> set[str]:
    return {p for p, m in model.named_modules()
            if isinstance(m, nn.Linear | nn.QuantizedLinear) and p.startswith("talker.")}  # fmt: skip


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_uniform_variants_quantize_every_talker_linear(source, bits):
    model, details = load(resolve(str(source), f"{bits}bit"), progress=False)
    assert details["quantized_on_load"] and not details["from_cache"]
    q = quantized_modules(model)
    talker_linears = _linear_paths(model)
    assert talker_linears and talker_linears <= set(q)
    assert set(q.values()) == {bits}
    assert not any("embedding" in p or p.startswith("speech_tokenizer") for p in q)
    # the cached checkpoint records every quantized module for mlx-audio's loader
    cfg = json.loads((Path(details["path"]) / "config.json").read_text())
    assert cfg["quantization"]["bits"] == bits
    assert cfg["quantization"]["talker.model.layers.0.mlp.up_proj"] == {
        "bits": bits,
        "group_size": 64,
    }

    again, details2 = load(resolve(str(source), f"{bits}bit"), progress=False)
    assert details2["from_cache"] and not details2["quantized_on_load"]
    assert details2["path"] == details["path"]
    assert quantized_modules(again) == q


def test_talker_mlp_w4_quantizes_only_the_middle_mlps(source):
    model, details = load(resolve(str(source), "talker-mlp-w4"), progress=False)
    q = quantized_modules(model)
    expected = {
        f"talker.model.layers.{i}.mlp.{p}_proj" for i in (2, 3) for p in ("gate", "up", "down")
    }
    assert set(q) == expected
    assert set(q.values()) == {4}
    # everything else stays a plain (bf16) Linear
    assert isinstance(model.talker.model.layers[0].self_attn.q_proj, nn.Linear)
    assert isinstance(model.talker.model.layers[4].mlp.up_proj, nn.Linear)
    assert load(resolve(str(source), "talker-mlp-w4"), progress=False)[1]["from_cache"]


def test_quantized_variant_streams(source):
    model, _ = load(resolve(str(source), "4bit"), progress=False)
    chunks = list(stream_chunks(model, SpeechRequest(input="Four bits.", voice="ryan",
                                                     max_new_tokens=4, seed=0)))  # fmt: skip
    assert [c.frames for c in chunks] == [4] and chunks[0].audio.shape == (7680,)


def test_prequantized_directory_loads_as_is(tiny_checkpoint):
    path = tiny_checkpoint("custom_voice", bits=8)
    src = resolve(str(path))
    assert src.variant == "8bit" and src.quantize_with is None
    model, details = load(src, progress=False)
    assert not details["quantized_on_load"] and set(quantized_modules(model).values()) == {8}
    with pytest.raises(ValueError, match="already quantized"):
        resolve(str(path), "4bit")


def test_two_layer_checkpoint_has_nothing_for_talker_mlp_w4(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantizes no module"):
        load(resolve(str(tiny_checkpoint("custom_voice")), "talker-mlp-w4"), progress=False)


def test_embedding_rungs_load_quantized_embeddings_and_stream(source):
    """mlx-audio's loader refuses quantized embeddings; the engine's loader reads them back."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, details = load(resolve(str(source), "4bit-emb4-voc16"), progress=False)
    q = quantized_modules(model)
    embeddings = {p for p in q if "embedding" in p}
    assert embeddings == {
        "talker.model.text_embedding",
        "talker.model.codec_embedding",
        *(f"talker.code_predictor.model.codec_embedding.{i}" for i in range(15)),
    }
    assert isinstance(model.talker.model.text_embedding, nn.QuantizedEmbedding)
    assert set(q.values()) == {4}
    cfg = json.loads((Path(details["path"]) / "config.json").read_text())
    assert cfg["quantization"]["talker.model.text_embedding"] == {"bits": 4, "group_size": 64}
    assert cfg["qwen3_tts_vocoder_dtype"] == "bfloat16"
    assert {v.dtype for _, v in tree_flatten(model.speech_tokenizer.decoder.parameters())} == {
        mx.bfloat16
    }
    assert model.speech_tokenizer.encoder_model is None  # CustomVoice never clones a voice
    chunks = list(stream_chunks(model, SpeechRequest(input="Small.", voice="ryan",
                                                     max_new_tokens=4, seed=0)))  # fmt: skip
    assert [c.frames for c in chunks] == [4] and chunks[0].audio.dtype == "float32"
    # the cached directory is a checkpoint of its own: loaded as is, named by its recipe
    again, d2 = load(resolve(details["path"]), progress=False)
    assert not d2["quantized_on_load"] and quantized_modules(again) == q
    assert resolve(details["path"]).variant == "4bit-emb4-voc16"
