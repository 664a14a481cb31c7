"""Tiny random Qwen3-TTS checkpoints: mlx-audio loads them bit-exactly and streams from them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizer
from mlx_audio.tts.utils import load_model

from qwen3_tts_engine.tiny_checkpoints.builder import (
    VARIANTS,
    tiny_config,
    write_tiny_checkpoint,
)

TEXT = "Hello there. How are you?"
CHUNK = 4 * 1920  # 0.32 s at 12.5 frames/s, 1920 samples per frame
EOS_ID = 2150
# name -> write_tiny_checkpoint keyword arguments
BUILDS = {
    "custom_voice": {"variant": "custom_voice"},
    "base": {"variant": "base"},
    "voice_design": {"variant": "voice_design"},
    "custom_voice-4bit": {"variant": "custom_voice", "bits": 4},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> Path, built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_tiny_checkpoint(
                tmp_path_factory.mktemp("tiny") / name, **BUILDS[name]
            )
        return built[name]

    return get


@pytest.fixture(scope="module")
def model(checkpoint):
    """model(name) -> the checkpoint loaded by mlx-audio's own loader, once per module."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            m = load_model(checkpoint(name))
            assert m.tokenizer is not None, "text tokenizer failed to load"
            assert m.speech_tokenizer is not None, "speech tokenizer failed to load"
            loaded[name] = m
        return loaded[name]

    return get


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _ref_audio() -> mx.array:
    t = np.arange(24000) / 24000
    wave = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return mx.array(wave.astype(np.float32))


def _codec_head_row(m, row: int) -> np.ndarray:
    head = m.talker.codec_head
    if isinstance(head, nn.QuantizedLinear):
        w = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
    else:
        w = head.weight
    return np.array(w[row].astype(mx.float32))


def test_config_keeps_the_real_ids():
    cfg = tiny_config("custom_voice")
    talker = cfg["talker_config"]
    assert (cfg["im_start_token_id"], cfg["im_end_token_id"]) == (151644, 151645)
    assert (cfg["tts_pad_token_id"], cfg["tts_bos_token_id"], cfg["tts_eos_token_id"]) == (
        151671,
        151672,
        151673,
    )
    assert talker["codec_eos_token_id"] == EOS_ID and talker["codec_bos_id"] == 2149
    assert talker["codec_language_id"]["english"] == 2050
    assert talker["codec_language_id"]["chinese"] == 2055
    assert {"ryan", "vivian", "serena"} <= set(talker["spk_id"])
    assert talker["num_code_groups"] == 16 and talker["vocab_size"] == 3072
    assert talker["text_vocab_size"] > 151673
    assert sum(talker["rope_scaling"]["mrope_section"]) == talker["head_dim"] // 2
    assert cfg["tts_model_size"] == "0b6"
    for variant in VARIANTS:
        assert tiny_config(variant)["tts_model_type"] == variant
    assert tiny_config("base")["talker_config"]["spk_id"] == {}
    assert tiny_config(talker_layers=9)["talker_config"]["num_hidden_layers"] == 9
    with pytest.raises(ValueError):
        tiny_config("big")


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        write_tiny_checkpoint(tmp_path, bits=3)
    with pytest.raises(ValueError):
        write_tiny_checkpoint(tmp_path, variant="clone")


@pytest.mark.parametrize("name", list(BUILDS))
def test_streams_two_full_chunks(model, name):
    m = model(name)
    kwargs = {}
    if m.config.tts_model_type == "custom_voice":
        kwargs = {"voice": "ryan", "instruct": "Very happy."}
    elif m.config.tts_model_type == "voice_design":
        kwargs = {"instruct": "A deep, calm male voice."}
    else:  # base: ICL cloning needs the speaker encoder and the speech tokenizer's encoder
        assert m.speaker_encoder is not None and m.speech_tokenizer.has_encoder
        kwargs = {"ref_audio": _ref_audio(), "ref_text": "This is what my voice sounds like."}
    mx.random.seed(0)
    chunks = [
        np.array(r.audio)
        for r in m.generate(
            text=TEXT,
            lang_code="english",
            stream=True,
            streaming_interval=0.32,
            max_tokens=8,
            **kwargs,
        )
    ]
    assert [c.shape for c in chunks] == [(CHUNK,), (CHUNK,)]
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all()
    assert 0.0 < np.abs(audio).max() <= 1.0
    assert np.abs(audio).mean() > 1e-3  # not silence


def test_tokenizer_ids_and_prompt_slicing(model):
    tok = model("custom_voice").tokenizer
    ids = tok.encode(f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "assistant", "Ċ"]
    assert tok.convert_ids_to_tokens(ids[-5:]) == [
        "<|im_end|>",
        "Ċ",
        "<|im_start|>",
        "assistant",
        "Ċ",
    ]
    assert ids[0] == 151644 and ids[-5] == 151645
    assert tok.decode(ids[3:-5]) == TEXT
    assert len(tok.encode("<|im_start|>user\n")) == 3
    for token, expected in {"<tts_pad>": 151671, "<tts_text_bos>": 151672,
                            "<tts_text_eod>": 151673, "<|endoftext|>": 151643}.items():  # fmt: skip
        assert tok.convert_tokens_to_ids(token) == expected


@pytest.mark.parametrize("name", ["custom_voice", "base"])
def test_loads_back_bit_exactly(checkpoint, model, name):
    root, m = checkpoint(name), model(name)

    # root weights: the MLX layout that mlx_audio.convert writes
    saved = mx.load(str(root / "model.safetensors"))
    params = {
        k: v for k, v in tree_flatten(m.parameters()) if not k.startswith("speech_tokenizer.")
    }
    assert set(params) == set(saved)
    for k, v in saved.items():
        assert v.dtype == mx.bfloat16 and params[k].dtype == v.dtype, k
        assert bool(mx.array_equal(params[k], v)), k
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(saved)

    # speech tokenizer: the PyTorch layout of the original repo, converted by sanitize
    raw = mx.load(str(root / "speech_tokenizer" / "model.safetensors"))
    assert raw["decoder.decoder.2.block.4.conv2.conv.weight"].shape == (65, 65, 1)  # (out, in, k)
    assert raw["decoder.upsample.0.0.conv.weight"].shape == (64, 64, 2)  # (in, out, k)
    assert raw["encoder.encoder.layers.0.conv.weight"].shape == (8, 1, 7)
    assert "decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum" in raw
    assert "encoder.encoder_transformer.layers.0.self_attn.q_proj.weight" in raw
    expected = Qwen3TTSSpeechTokenizer.sanitize(dict(raw))
    st = m.speech_tokenizer
    loaded = {f"decoder.{k}": v for k, v in tree_flatten(st.decoder.parameters())}
    loaded |= {f"encoder_model.{k}": v for k, v in tree_flatten(st.encoder_model.parameters())}
    # every parameter comes from the file (none keeps its random constructor value) ...
    uncovered = {k for k in set(loaded) - set(expected) if not k.endswith(".initialized")}
    assert not uncovered
    assert set(expected) <= set(loaded)
    # ... bit for bit
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype == mx.float32, k
        assert loaded[k].shape == v.shape and bool(mx.array_equal(loaded[k], v)), k

    # EOS can never be sampled: its codec-head row is zero
    assert not _codec_head_row(m, EOS_ID).any()
    assert _codec_head_row(m, EOS_ID - 1).any()


def test_quantized_checkpoint(checkpoint, model):
    root, m = checkpoint("custom_voice-4bit"), model("custom_voice-4bit")
    config = json.loads((root / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]

    talker = m.talker
    linears = [talker.codec_head, talker.text_projection.linear_fc1, *talker.code_predictor.lm_head]
    for layer in [*talker.model.layers, *talker.code_predictor.model.layers]:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    for layer in linears:
        assert isinstance(layer, nn.QuantizedLinear)
        assert (layer.bits, layer.group_size) == (4, 64)
    embeddings = [talker.model.codec_embedding, talker.model.text_embedding]
    embeddings += list(talker.code_predictor.model.codec_embedding)
    for emb in embeddings:
        assert type(emb) is nn.Embedding
    # nothing of the speech tokenizer is quantized
    assert not [
        k for k in mx.load(str(root / "speech_tokenizer/model.safetensors")) if "scales" in k
    ]
    assert not _codec_head_row(m, EOS_ID).any()


def test_same_seed_same_bytes_other_seed_differs(checkpoint, tmp_path):
    first = checkpoint("custom_voice")
    again = write_tiny_checkpoint(tmp_path / "again", variant="custom_voice", seed=0)
    assert _hashes(first) == _hashes(again)

    other = write_tiny_checkpoint(tmp_path / "other", seed=1, eos=True, talker_layers=8)
    a, b = _hashes(first), _hashes(other)
    assert set(a) == set(b)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["speech_tokenizer/model.safetensors"] != b["speech_tokenizer/model.safetensors"]
    assert a["vocab.json"] == b["vocab.json"] and a["merges.txt"] == b["merges.txt"]
    m = load_model(other)
    assert len(m.talker.model.layers) == 8
    assert _codec_head_row(m, EOS_ID).any()  # eos=True keeps the row random
