"""Tiny, randomly initialised Qwen3-TTS checkpoints in the on-disk format of the real 12 Hz repos.

mlx-audio loads and streams from them through its normal code path; they exist for offline tests
and the offline demo. `python -m qwen3_tts_engine.tiny_checkpoints.builder OUT [--variant ...]`
writes one (`tiny_checkpoints.default_tiny_checkpoint` runs it so, in a child process).
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from qwen3_tts_engine.fast_blas import use_fast_blas
from qwen3_tts_engine.open_files import import_mlx_lm

use_fast_blas()  # before mlx loads (fast_blas.py)
import_mlx_lm()  # before mlx-audio imports it (open_files.py)

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_audio.lm.convert import quantize_model, save_config, save_model
from mlx_audio.tts.models.qwen3_tts import qwen3_tts as q3
from mlx_audio.tts.models.qwen3_tts.config import (
    ModelConfig,
    Qwen3TTSTokenizerConfig,
    Qwen3TTSTokenizerDecoderConfig,
    Qwen3TTSTokenizerEncoderConfig,
    filter_dict_for_dataclass,
)
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizer
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

VARIANTS = ("custom_voice", "base", "voice_design")
QUANT_BITS = (4, 6, 8)

# Token ids and maps as in the real Qwen/Qwen3-TTS-12Hz-* config.json files.
_TEXT_VOCAB_SIZE = 151936
_CODEC_VOCAB_SIZE = 3072
_CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
_LANGUAGES = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
_DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
_SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
_SPEAKER_DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

# Qwen3 added tokens (ids 151643..151675), as (content, special); the TTS ones end the list.
_FIRST_ADDED_ID = 151643
_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
_ADDED_IDS = {tok: _FIRST_ADDED_ID + i for i, (tok, _) in enumerate(_ADDED_TOKENS)}

_QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_BPE_VOCAB_SIZE = 1024  # upper bound; the corpus yields ~570 tokens
_CORPUS = """\
Hello there. How are you? I am fine, thank you. Good morning, good evening and good night.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
Please speak slowly and clearly. Could you say that again? Yes, of course. No, not today.
What time is it? It is ten past nine. Where are we going? We are going to the station.
This is a test of the text to speech system. The weather is nice and the sun is shining.
Speak in a calm, warm and friendly voice. A cheerful young female voice with a high pitch.
A deep male voice, slow and serious. Very happy and excited. Sad and tired, almost whispering.
One two three four five six seven eight nine ten. Numbers like 42 and 2025 are read aloud.
Thanks for calling, how can I help you today? Let me check that for you, one moment please.
"""
_CORPUS_REPEATS = 8
_ROLE_WORDS = ("assistant", "user", "system")


def _talker_config(
    variant: str, talker_layers: int, intermediate_size: int = 128
) -> dict[str, Any]:
    languages = dict(_LANGUAGES)
    if variant == "custom_voice":
        languages.update(_DIALECTS)
        spk_id: dict[str, int] = dict(_SPEAKERS)
        spk_is_dialect: dict[str, Any] = {
            name: _SPEAKER_DIALECTS.get(name, False) for name in _SPEAKERS
        }
    else:
        spk_id, spk_is_dialect = {}, {}
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "code_predictor_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "intermediate_size": 128,
            "layer_types": ["full_attention"],
            "max_length": 20,
            "max_position_embeddings": 65536,
            "model_type": "qwen3_tts_talker_code_predictor",
            "num_attention_heads": 4,
            "num_code_groups": 16,
            "num_hidden_layers": 1,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 2048,
        },
        **_CODEC_IDS,
        "codec_language_id": languages,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 32768,
        "model_type": "qwen3_tts_talker",
        "num_attention_heads": 4,
        "num_code_groups": 16,
        "num_hidden_layers": talker_layers,
        "num_key_value_heads": 2,
        "position_id_per_seconds": 13,
        "rms_norm_eps": 1e-06,
        # mrope_section sums to head_dim / 2, like [24, 20, 20] for head_dim 128
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": [4, 2, 2],
            "rope_type": "default",
            "type": "default",
        },
        "rope_theta": 1000000,
        "sliding_window": None,
        "spk_id": spk_id,
        "spk_is_dialect": spk_is_dialect,
        "text_hidden_size": 64,
        "text_vocab_size": _TEXT_VOCAB_SIZE,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _CODEC_VOCAB_SIZE,
    }


def tiny_config(
    variant: str = "custom_voice",
    *,
    talker_layers: int = 2,
    tts_model_size: str = "0b6",
    talker_intermediate_size: int = 128,
) -> dict[str, Any]:
    """The root config.json of a tiny checkpoint (before any quantization entry).

    Real token ids, language/speaker maps and 16 code groups; tiny layer sizes. Every
    quantizable weight has an input size that is a multiple of 64.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if talker_layers < 1:
        raise ValueError("talker_layers must be >= 1")
    if talker_intermediate_size < 64 or talker_intermediate_size % 64:
        raise ValueError("talker_intermediate_size must be a positive multiple of 64")
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "assistant_token_id": 77091,
        "im_end_token_id": _ADDED_IDS["<|im_end|>"],
        "im_start_token_id": _ADDED_IDS["<|im_start|>"],
        "model_type": "qwen3_tts",
        # Conv channel counts stay above 64: mlx-audio's layout heuristic relies on it.
        "speaker_encoder_config": {
            "enc_attention_channels": 128,
            "enc_channels": [128, 128, 128, 128, 384],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_dim": 64,
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_res2net_scale": 8,
            "enc_se_channels": 128,
            "mel_dim": 128,
            "sample_rate": 24000,
        },
        "talker_config": _talker_config(variant, talker_layers, talker_intermediate_size),
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
        "tts_bos_token_id": _ADDED_IDS["<tts_text_bos>"],
        "tts_eos_token_id": _ADDED_IDS["<tts_text_eod>"],
        "tts_model_size": tts_model_size,
        "tts_model_type": variant,
        "tts_pad_token_id": _ADDED_IDS["<tts_pad>"],
    }


def _speech_tokenizer_config() -> dict[str, Any]:
    """speech_tokenizer/config.json: 12.5 Hz frames, 1920 samples per frame, 16 code groups."""
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "decode_upsample_rate": 1920,
        "decoder_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "codebook_dim": 160,
            "codebook_size": 2048,
            # decoder_dim / 2**2 = 65 channels in the last block: above the heuristic's 64
            "decoder_dim": 260,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "intermediate_size": 128,
            "latent_dim": 64,
            "layer_scale_initial_scale": 0.01,
            "max_position_embeddings": 8000,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "num_quantizers": 16,
            "num_semantic_quantizers": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000,
            "semantic_codebook_size": 4096,
            "sliding_window": 72,
            # product 480 (x 2 x 2 = 1920 samples per frame); the real model uses [8, 5, 4, 3].
            # Two blocks instead of four: each block's residual units run dilated convolutions
            # (dilations 1, 3, 9), ~100x slower than plain ones on mlx-cpu; the last block at
            # 24 kHz costs the same either way. ~20 % cheaper per chunk than [2, 2, 4, 30].
            "upsample_rates": [16, 30],
            "upsampling_ratios": [2, 2],
            "vector_quantization_hidden_dimension": 160,
        },
        "encode_downsample_rate": 1920,
        "encoder_config": {
            "_frame_rate": 12.5,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "audio_channels": 1,
            "codebook_dim": 16,
            "codebook_size": 2048,
            "compress": 2,
            "dilation_growth_rate": 2,
            "frame_rate": 12.5,
            "head_dim": 16,
            "hidden_act": "gelu",
            "hidden_size": 64,
            "intermediate_size": 128,
            "kernel_size": 7,
            "last_kernel_size": 3,
            "layer_scale_initial_scale": 0.01,
            "max_position_embeddings": 8000,
            "model_type": "mimi",
            "norm_eps": 1e-05,
            "num_attention_heads": 4,
            "num_filters": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "num_quantizers": 32,
            "num_residual_layers": 1,
            "num_semantic_quantizers": 1,
            "pad_mode": "constant",
            "residual_kernel_size": 3,
            "rope_theta": 10000.0,
            "sampling_rate": 24000,
            "sliding_window": 250,
            "trim_right_ratio": 1.0,
            "upsample_groups": 64,
            "upsampling_ratios": [8, 6, 5, 4],
            "use_cache": False,
            "use_causal_conv": True,
            "use_conv_shortcut": False,
            "vector_quantization_hidden_dimension": 16,
        },
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "model_type": "qwen3_tts_tokenizer_12hz",
        "output_sample_rate": 24000,
        "transformers_version": "4.57.3",
    }


_GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}


# ----------------------------------------------------------------------------- weights


def _rng(seed: int, name: str) -> np.random.Generator:
    # One stream per parameter name: adding layers leaves the other weights unchanged.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _random_param(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = _rng(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        if leaf == "bias":
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)
        if leaf in ("alpha", "beta"):  # SnakeBeta, stored as logs
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if leaf in ("scale", "gamma"):  # layer scales
            return (0.1 + 0.02 * rng.standard_normal(shape)).astype(np.float32)
        # norm weights
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "embedding" in name or name.endswith("codebook.embed.weight"):
        return rng.standard_normal(shape, dtype=np.float32)
    fan_in = int(np.prod(shape[1:]))
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)


def _cluster_usage(name: str, size: int, seed: int) -> np.ndarray:
    # Powers of two: embedding_sum / cluster_usage then gives back the codebook exactly.
    return np.exp2(_rng(seed, name).integers(0, 8, size)).astype(np.float32)


def _random_tree(module, seed: int, dtype=None) -> dict:
    out = {}
    for name, value in tree_flatten(module.parameters()):
        arr = mx.array(_random_param(name, tuple(value.shape), seed))
        out[name] = arr.astype(dtype) if dtype is not None else arr
    return out


# --- speech tokenizer: MLX layout -> the PyTorch layout of the real speech_tokenizer files

_SEANET_DIRECT = {"init_conv1d": 0, "final_conv1d": 14}  # encoder.encoder.layers.{N}


def _encoder_hf_name(name: str) -> str | None:
    """Real (transformers Mimi) name of an mlx-audio encoder parameter; inverse of sanitize."""
    p = name.split(".")
    assert p[0] == "encoder_model"
    if p[1] == "encoder":
        leaf = p[-1]
        if p[2] in _SEANET_DIRECT:
            return f"encoder.encoder.layers.{_SEANET_DIRECT[p[2]]}.conv.{leaf}"
        j = int(p[3])
        if p[4] == "downsample":
            return f"encoder.encoder.layers.{3 + 3 * j}.conv.{leaf}"
        if p[4] == "residuals" and p[5] == "0":
            block = {"0": 1, "1": 3}[p[7]]
            return f"encoder.encoder.layers.{1 + 3 * j}.block.{block}.conv.{leaf}"
        return None
    if p[1] == "encoder_transformer":
        i, rest = int(p[4]), ".".join(p[5:])
        hf_rest = {
            "self_attn.out_proj.weight": "self_attn.o_proj.weight",
            "gating.linear1.weight": "mlp.fc1.weight",
            "gating.linear2.weight": "mlp.fc2.weight",
            "norm1.weight": "input_layernorm.weight",
            "norm1.bias": "input_layernorm.bias",
            "norm2.weight": "post_attention_layernorm.weight",
            "norm2.bias": "post_attention_layernorm.bias",
            "layer_scale_1.scale": "self_attn_layer_scale.scale",
            "layer_scale_2.scale": "mlp_layer_scale.scale",
        }.get(rest)
        return None if hf_rest is None else f"encoder.encoder_transformer.layers.{i}.{hf_rest}"
    if p[1] == "downsample":
        return "encoder.downsample.conv.weight"
    if p[1] == "quantizer":
        rvq = {"rvq_first": "semantic", "rvq_rest": "acoustic"}[p[2]]
        prefix = f"encoder.quantizer.{rvq}_residual_vector_quantizer"
        if p[3] in ("input_proj", "output_proj"):
            return f"{prefix}.{p[3]}.weight"
        leaf = {"embedding_sum": "embed_sum"}.get(p[-1], p[-1])
        return f"{prefix}.layers.{p[5]}.codebook.{leaf}"
    return None


def _speech_tokenizer_weights(st_module, seed: int) -> tuple[dict, dict]:
    """(expected MLX-layout parameters, the same weights in the real PyTorch-layout file)."""
    # Random weights drive the vocoder into clipping; a quieter output conv gives audio with
    # a standard deviation of ~0.15 instead.
    last = len(st_module.decoder.decoder) - 1
    gains = {f"decoder.decoder.{last}.conv.weight": 0.05, f"decoder.decoder.{last}.conv.bias": 0.0}
    mlx_params: dict[str, Any] = {}
    hf: dict[str, Any] = {}
    for name, value in tree_flatten(st_module.parameters()):
        shape = tuple(value.shape)
        key = f"speech_tokenizer.{name}"
        if name.startswith("decoder."):
            if name.endswith(".codebook.embed.weight"):
                embed = _random_param(key, shape, seed)
                usage = _cluster_usage(key + ".usage", shape[0], seed)
                base = name[: -len(".codebook.embed.weight")]
                hf[f"{base}._codebook.embedding_sum"] = mx.array(embed * usage[:, None])
                hf[f"{base}._codebook.cluster_usage"] = mx.array(usage)
                mlx_params[name] = mx.array(embed)
                continue
            arr = mx.array(_random_param(key, shape, seed) * gains.get(name, 1.0))
            mlx_params[name] = arr
            is_transpose_conv = ("upsample" in name and ".0.conv.weight" in name) or (
                "decoder.decoder" in name and "block.1.conv.weight" in name
            )
            if arr.ndim == 3 and is_transpose_conv:
                hf[name] = mx.transpose(arr, (2, 0, 1))  # (out, k, in) -> (in, out, k)
            elif arr.ndim == 3:
                hf[name] = mx.transpose(arr, (0, 2, 1))  # (out, k, in) -> (out, in, k)
            else:
                hf[name] = arr
            continue

        leaf = name.rsplit(".", 1)[-1]
        if leaf == "initialized":
            # sanitize skips the flag; the module keeps its constructor value
            mlx_params[name] = value
            hf[_encoder_hf_name(name)] = mx.ones((1,), dtype=mx.float32)
            continue
        if leaf == "cluster_usage":
            arr = mx.array(_cluster_usage(key, shape[0], seed))
        elif leaf == "embedding_sum":
            usage = _cluster_usage(key.replace("embedding_sum", "cluster_usage"), shape[0], seed)
            arr = mx.array(_random_param(key, shape, seed) * usage[:, None])
        else:
            arr = mx.array(_random_param(key, shape, seed))
        mlx_params[name] = arr
        if ".self_attn.in_proj.weight" in name:  # q, k, v stacked
            i = name.split(".")[4]
            q, k, v = mx.split(arr, 3, axis=0)
            base = f"encoder.encoder_transformer.layers.{i}.self_attn"
            hf[f"{base}.q_proj.weight"], hf[f"{base}.k_proj.weight"] = q, k
            hf[f"{base}.v_proj.weight"] = v
            continue
        hf_name = _encoder_hf_name(name)
        if hf_name is None:
            raise RuntimeError(f"no real-checkpoint name for speech tokenizer parameter {name}")
        hf[hf_name] = mx.swapaxes(arr, -1, -2) if arr.ndim == 3 else arr
    return mlx_params, hf


def _check_round_trip(sanitized: dict, expected: dict, what: str, skip=()) -> None:
    missing = sorted(set(expected) - set(sanitized) - set(skip))
    extra = sorted(set(sanitized) - set(expected))
    if missing or extra:
        raise RuntimeError(f"{what}: sanitize mismatch; missing {missing[:5]}, extra {extra[:5]}")
    for k, v in sanitized.items():
        e = expected[k]
        if v.shape != e.shape or v.dtype != e.dtype or not bool(mx.array_equal(v, e)):
            raise RuntimeError(f"{what}: {k} does not load back bit-exactly")


# ----------------------------------------------------------------------------- end of speech

EOS_MODES = ("never", "random", "text", "loop")
# Residual-stream dimensions that the "text" mode reserves (the last three of 64).
_MARK, _COUNT, _SCORE = 61, 62, 63
# Values chosen by measurement (the eos tests in tests/engine/worker/test_synthesis.py): about 1.3 frames
# per text token plus four, and an EOS logit that swings from about -60 to +60 around the crossing.
_MARK_VALUE, _COUNT_VALUE, _ALPHA, _THETA, _BETA = 8.0, 8.0, 4.0, 0.42, 64.0


def _edit(weights: dict, name: str, fn) -> None:
    """Apply `fn` in place to a float32 numpy copy of `weights[name]`, kept in its dtype."""
    arr = np.array(weights[name].astype(mx.float32))
    fn(arr)
    weights[name] = mx.array(arr).astype(weights[name].dtype)


def _keep_channels_free(weights: dict, talker: dict, reserved: list[int]) -> None:
    """No part of the network but the codec embedding writes the residual channels `reserved`:
    the code predictor's embeddings, the text projection, every layer's MLP and attention output
    are zero there, so the hand-set channels carry only what the edit puts in them."""
    for i in range(talker["num_code_groups"] - 1):
        _edit(weights, f"talker.code_predictor.model.codec_embedding.{i}.weight",
              lambda w: w.__setitem__((slice(None), reserved), 0.0))  # fmt: skip
    for leaf in ("weight", "bias"):
        _edit(weights, f"talker.text_projection.linear_fc2.{leaf}",
              lambda w: w.__setitem__(reserved, 0.0))  # fmt: skip
    for layer in range(talker["num_hidden_layers"]):
        base = f"talker.model.layers.{layer}"
        _edit(weights, f"{base}.mlp.down_proj.weight", lambda w: w.__setitem__(reserved, 0.0))
        _edit(weights, f"{base}.self_attn.o_proj.weight", lambda w: w.__setitem__(reserved, 0.0))


def _text_length_eos(weights: dict, config: dict) -> None:
    """Wire the talker so that it emits EOS after a number of frames that grows with the text.

    The whole text is in the prefill; every generated frame's input embeds a codebook-0 token
    (< 2048) while prefill positions embed control tokens (>= 2048), and each text position
    carries `codec_pad`. Dimension _MARK is set on generated frames only, _COUNT on text
    positions only; one layer-0 attention head with a zero query averages both over all
    positions, and writes mark - theta * count to _SCORE, which only the EOS row of the codec
    head reads. EOS wins once the generated frames outweigh the text: deterministic for a given
    text and seed, and longer text ends later. Every edited row keeps at most two non-zero
    entries, so 8- and 4-bit quantization keeps the behaviour (zero is exact in MLX's grid).
    Limitation: in-context cloning (a Base model given ref_audio and ref_text) puts the reference's
    codes into the prefill, where they count as generated frames: EOS comes early or at once.
    """
    talker = config["talker_config"]
    reserved = [_MARK, _COUNT, _SCORE]

    def edit(name, fn):
        _edit(weights, name, fn)

    def codec_embedding(w):
        w[:, reserved] = 0.0
        w[:2048, _MARK] = _MARK_VALUE  # codebook-0 codes of generated frames
        w[talker["codec_pad_id"], _COUNT] = _COUNT_VALUE  # one per text position

    edit("talker.model.codec_embedding.weight", codec_embedding)
    _keep_channels_free(weights, talker, reserved)
    head_dim = talker["head_dim"]
    base = "talker.model.layers.0"
    # Head 0 attends uniformly (zero query); its kv head's last two value dims read the counters.
    edit(f"{base}.self_attn.q_proj.weight", lambda w: w.__setitem__(slice(0, head_dim), 0.0))
    edit(f"{base}.input_layernorm.weight", lambda w: w.__setitem__([_MARK, _COUNT], 1.0))
    j_mark, j_count = head_dim - 2, head_dim - 1

    def v_proj(w):
        w[[j_mark, j_count]] = 0.0
        w[j_mark, _MARK] = 1.0
        w[j_count, _COUNT] = 1.0

    def o_proj(w):
        w[_SCORE, j_mark] = _ALPHA
        w[_SCORE, j_count] = -_ALPHA * _THETA

    edit(f"{base}.self_attn.v_proj.weight", v_proj)
    edit(f"{base}.self_attn.o_proj.weight", o_proj)
    edit("talker.model.norm.weight", lambda w: w.__setitem__(_SCORE, 1.0))

    def codec_head(w):
        w[:, _SCORE] = 0.0
        w[talker["codec_eos_token_id"]] = 0.0
        w[talker["codec_eos_token_id"], _SCORE] = _BETA

    edit("talker.codec_head.weight", codec_head)


# Two codebook-0 codes the "loop" mode cycles between, and the residual dimensions it reserves.
LOOP_CODES = (100, 200)
_LOOP_AFTER_OTHER, _LOOP_AFTER_A = 61, 62
_LOOP_MARK, _LOOP_BETA = 8.0, 64.0


def _looping_talker(weights: dict, config: dict) -> None:
    """Wire the talker into a two-code cycle that never ends (a stuck model, for the loop
    detector's tests): EOS is never sampled, and each frame's codebook-0 code decides the next.

    A generated frame's input embeds its codebook-0 code: code A writes dimension
    _LOOP_AFTER_A, every other code < 2048 writes _LOOP_AFTER_OTHER; nothing else writes either
    (the text projection, attention and MLP outputs are zeroed there), and the final norm passes
    them. The codec head's row A reads _LOOP_AFTER_OTHER and row B reads _LOOP_AFTER_A, with a
    weight that outvotes every random logit: whatever the first frame samples, the codes then run
    A, B, A, B... for any seed and sampling setting (the first frame's input is a prefill
    position, which writes neither)."""
    talker = config["talker_config"]
    a, b = LOOP_CODES
    reserved = [_LOOP_AFTER_OTHER, _LOOP_AFTER_A]

    def edit(name, fn):
        _edit(weights, name, fn)

    def codec_embedding(w):
        w[:, reserved] = 0.0
        w[:2048, _LOOP_AFTER_OTHER] = _LOOP_MARK
        w[a, _LOOP_AFTER_OTHER] = 0.0
        w[a, _LOOP_AFTER_A] = _LOOP_MARK

    edit("talker.model.codec_embedding.weight", codec_embedding)
    _keep_channels_free(weights, talker, reserved)
    edit("talker.model.norm.weight", lambda w: w.__setitem__(reserved, 1.0))

    def codec_head(w):
        w[:, reserved] = 0.0
        w[talker["codec_eos_token_id"]] = 0.0
        w[a, _LOOP_AFTER_OTHER] = _LOOP_BETA
        w[b, _LOOP_AFTER_A] = _LOOP_BETA

    edit("talker.codec_head.weight", codec_head)


# ----------------------------------------------------------------------------- tokenizer


def _train_bpe() -> tuple[dict[str, int], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    roles = "".join(f"{w}\n" for w in _ROLE_WORDS)
    corpus = [_CORPUS] * _CORPUS_REPEATS + [roles] * (4 * _CORPUS_REPEATS)
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    for word in _ROLE_WORDS:
        if word not in vocab:
            raise RuntimeError(f"tiny BPE did not learn {word!r} as one token")
    return vocab, merges


def write_tokenizer(out: Path) -> None:
    vocab, merges = _train_bpe()
    # Pad the vocabulary with unreachable tokens to the real size (151643 entries), so that
    # the added tokens get the ids that config.json refers to (<|im_start|> = 151644, ...).
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise RuntimeError("trained vocabulary ids are not contiguous")
    full = dict(by_id)
    for i in range(len(full), _FIRST_ADDED_ID):
        full[f"<|tiny_unused_{i}|>"] = i
    (out / "vocab.json").write_text(json.dumps(full, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {
        str(_ADDED_IDS[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for tok, special in _ADDED_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, s in _ADDED_TOKENS if s and t != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# ----------------------------------------------------------------------------- writer


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    variant: str = "custom_voice",
    bits: int | None = None,
    seed: int = 0,
    group_size: int = 64,
    eos: bool | str = "never",
    talker_layers: int = 2,
    tts_model_size: str = "0b6",
    talker_intermediate_size: int = 128,
) -> Path:
    """Write a random tiny checkpoint to `out_dir` (created; files in it are overwritten).

    Layout as `mlx_audio.convert` leaves an `mlx-community/Qwen3-TTS-12Hz-*` repo: root
    `model.safetensors` (+ index) in MLX layout and bf16, `config.json`, `generation_config.json`,
    Qwen2 tokenizer files, and `speech_tokenizer/` (decoder and encoder) in the PyTorch layout
    of the original repo. `bits` (4, 6 or 8) quantizes with mlx-audio's own predicate.
    `eos` decides how an utterance ends: "never" (or False) zeroes the EOS row of the talker's
    codec head, so a stream always runs to `max_tokens` frames; "random" (or True) keeps the
    random row (EOS whenever sampling picks it); "text" ends each utterance by EOS after about
    one frame per text token plus two, deterministically for a given text and seed, as real
    models end theirs (see `_text_length_eos`); "loop" never ends and its codebook-0 codes fall
    into a two-code cycle at once (`_looping_talker`: the loop detector's test model).
    `talker_layers` sets the talker depth;
    `tts_model_size` "1b7" makes CustomVoice honour `instruct` (mlx-audio drops it for "0b6").
    A large `talker_intermediate_size` makes the quantizable weights dominate a worker's memory
    (the memory-governor tests).
    Same arguments, same bytes (mlx's global random state is advanced by module constructors).
    """
    eos = {False: "never", True: "random"}.get(eos, eos) if isinstance(eos, bool) else eos
    if eos not in EOS_MODES:
        raise ValueError(f"eos must be one of {EOS_MODES}, got {eos!r}")
    if bits is not None and bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS} or None, got {bits!r}")
    if group_size not in (32, 64):
        raise ValueError("group_size must be 32 or 64 (the tiny layers are 64 or 128 wide)")
    config = tiny_config(
        variant,
        talker_layers=talker_layers,
        tts_model_size=tts_model_size,
        talker_intermediate_size=talker_intermediate_size,
    )
    st_config = _speech_tokenizer_config()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # --- talker (+ speaker encoder for base): what convert saves is model.parameters()
    model = q3.Model(ModelConfig.from_dict(config))
    weights = _random_tree(model, seed, dtype=mx.bfloat16)
    if eos == "never":
        eos_id = config["talker_config"]["codec_eos_token_id"]
        head = np.array(weights["talker.codec_head.weight"].astype(mx.float32))
        head[eos_id] = 0.0
        weights["talker.codec_head.weight"] = mx.array(head).astype(mx.bfloat16)
    elif eos == "text":
        _text_length_eos(weights, config)
    elif eos == "loop":
        _looping_talker(weights, config)
    _check_round_trip(model.sanitize(dict(weights)), weights, "model.safetensors")
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    if bits is not None:

        def predicate(path, module):  # mlx_audio.convert's base_quant_requirements
            return (
                hasattr(module, "weight")
                and module.weight.shape[-1] % 64 == 0
                and hasattr(module, "to_quantized")
                and model.model_quant_predicate(path, module)
            )

        model, config = quantize_model(
            model, config, group_size, bits, mode="affine", quant_predicate=predicate
        )
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    (out / "generation_config.json").write_text(
        json.dumps(_GENERATION_CONFIG, indent=2) + "\n", encoding="utf-8"
    )
    write_tokenizer(out)

    # --- speech tokenizer, as shipped next to the model (PyTorch layout, float32)
    tok_cfg = Qwen3TTSTokenizerConfig(
        encoder_config=Qwen3TTSTokenizerEncoderConfig(
            **filter_dict_for_dataclass(Qwen3TTSTokenizerEncoderConfig, st_config["encoder_config"])
        ),
        decoder_config=Qwen3TTSTokenizerDecoderConfig(
            **filter_dict_for_dataclass(Qwen3TTSTokenizerDecoderConfig, st_config["decoder_config"])
        ),
    )
    speech_tokenizer = Qwen3TTSSpeechTokenizer(tok_cfg)
    expected, hf = _speech_tokenizer_weights(speech_tokenizer, seed)
    skip = [k for k in expected if k.endswith(".initialized")]
    _check_round_trip(
        Qwen3TTSSpeechTokenizer.sanitize(dict(hf)), expected, "speech_tokenizer", skip
    )
    del speech_tokenizer
    st_dir = out / "speech_tokenizer"
    st_dir.mkdir(exist_ok=True)
    mx.save_safetensors(
        str(st_dir / "model.safetensors"),
        {k: hf[k] for k in sorted(hf)},
        metadata={"format": "pt"},
    )
    (st_dir / "config.json").write_text(json.dumps(st_config, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a tiny random Qwen3-TTS checkpoint.")
    p.add_argument("out")
    p.add_argument(
        "--variant", default="custom_voice", choices=("custom_voice", "voice_design", "base")
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos", default="never", choices=EOS_MODES)
    args = p.parse_args(argv)
    write_tiny_checkpoint(args.out, variant=args.variant, seed=args.seed, eos=args.eos)


if __name__ == "__main__":
    main()
