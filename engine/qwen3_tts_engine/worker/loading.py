"""Loading a resolved model: hub download or local directory, quantize-on-load with a disk cache.

A full-precision checkpoint plus a quantized variant is converted once and cached under a key
made of the source's content digest and the recipe, so the next load is a plain load.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_audio.tts.models.qwen3_tts import Model, ModelConfig
from mlx_audio.utils import apply_quantization, get_model_path, load_config, load_weights
from tqdm import tqdm

from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.checkpoints import quantized_cache_dir
from qwen3_tts_engine.models.components import component_rule
from qwen3_tts_engine.models.recipes import ALWAYS_SKIPPED, Recipe, quantization_plan
from qwen3_tts_engine.models.variants import ModelSource
from qwen3_tts_engine.protocol import AUTO_COMPUTE, check_compute_dtype
from qwen3_tts_engine.worker.cpu_kernels import on_cpu, use_fast_cpu_kernels


class ModelUnavailable(RuntimeError):
    """A hub model that cannot be had here (offline, unknown id): the user's error, which the
    server says in one line (the worker prints no traceback for it)."""


def fetch(source: ModelSource) -> Path:
    """Local directory of the checkpoint; hub ids are downloaded (with progress bars)."""
    if source.local:
        return Path(source.source)
    try:
        return Path(get_model_path(source.source))
    except Exception as e:  # huggingface_hub raises many types when offline
        raise ModelUnavailable(
            f"cannot download {source.source!r} ({type(e).__name__}: {e}). Without a network, "
            "pass a local checkpoint directory, e.g. one made by `qwen3-tts tiny-checkpoint DIR`"
        ) from e


def load_full_precision(src: Path):
    """A full-precision checkpoint as an mlx-audio Model (weights only: no tokenizers)."""
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization"):
        raise ValueError(f"{src} is already quantized; quantize a full-precision checkpoint")
    model = Model(ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(load_weights(src)).items()))
    return model


def quantizable_modules(model) -> list[tuple[str, int]]:
    """(path, input width) of every module a recipe could quantize (Linear and Embedding),
    including modules already quantized (by GPTQ), whose packed weight is bits/32 as wide as
    their input."""
    return [
        (path, m.weight.shape[-1] * 32 // m.bits if hasattr(m, "bits") else m.weight.shape[-1])
        for path, m in model.named_modules()
        if (hasattr(m, "to_quantized") or hasattr(m, "bits")) and hasattr(m, "weight")
        and not any(s in path for s in ALWAYS_SKIPPED)
    ]  # fmt: skip


def recipe_plan(model, recipe: Recipe) -> dict[str, tuple[int, int]]:
    """Module path -> (bits, group size) that `recipe` gives a model's modules."""
    return quantization_plan(
        recipe, quantizable_modules(model), model.config.talker_config.num_hidden_layers
    )


def apply_recipe(
    model, recipe: Recipe, *, skip: frozenset[str] = frozenset()
) -> dict[str, tuple[int, int]]:
    """Quantize `model` in place (round to nearest) as `recipe` says; returns the plan.

    Paths in `skip` are left alone (e.g. already quantized by GPTQ) but stay in the plan.
    """
    plan = recipe_plan(model, recipe)
    # Every quantizable module is in the talker (ALWAYS_SKIPPED); quantizing only that subtree
    # also works on a loaded model, whose tokenizer attributes nn.quantize cannot walk.
    if any(not p.startswith("talker.") for p in plan):
        raise ValueError("recipes quantize modules of the talker only")
    nn.quantize(
        model.talker,
        class_predicate=lambda p, m: (
            {"bits": plan[f"talker.{p}"][0], "group_size": plan[f"talker.{p}"][1], "mode": "affine"}
            if f"talker.{p}" in plan and f"talker.{p}" not in skip else False
        ),
    )  # fmt: skip
    if recipe.vocoder_dtype and getattr(model, "speech_tokenizer", None) is not None:
        cast_vocoder(model, recipe.vocoder_dtype)
    return plan


def cast_vocoder(model, dtype: str) -> None:
    """The speech tokenizer's decoder in `dtype` (it ships in float32). The synthesis loop
    converts its output to float32, so only the vocoder's weights and activations shrink."""
    model.speech_tokenizer.decoder.set_dtype(getattr(mx, dtype))
    mx.eval(model.speech_tokenizer.decoder.parameters())


def release_freed_memory() -> None:
    """Give freed memory back to the system now: mlx's buffer cache, then glibc's heap. After a
    load, the weight files' buffers and dropped modules otherwise stay in the process's RSS."""
    mx.clear_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def save_quantized(model, src: Path, dst: Path, plan: dict, recipe: Recipe, *,
                   progress: bool = True, extra: dict | None = None) -> None:  # fmt: skip
    """Write a quantized `model` made from `src` to `dst` in mlx-audio's checkpoint format:
    tokenizer and speech-tokenizer files copied, weights saved, and each quantized module
    recorded in config.json["quantization"] so mixed precision loads with mlx-audio's loader."""
    if not plan:
        raise ValueError(f"recipe {recipe.name!r} quantizes no module of {src}")
    config = json.loads((src / "config.json").read_text())
    # A model from mlx-audio's loader also holds the vocoder, which lives in speech_tokenizer/.
    weights = {
        k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("speech_tokenizer.")
    }
    for key in tqdm(list(weights), desc=f"quantizing ({recipe.name})", unit="tensor",
                    disable=not progress, leave=False):  # fmt: skip
        mx.eval(weights[key])

    tmp = dst.with_name(dst.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in src.iterdir():
        if item.name == "config.json" or (
            item.is_file() and item.name.endswith((".safetensors", ".safetensors.index.json"))
        ):  # the weights are rewritten whole
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    first_bits, first_group = next(iter(plan.values()))
    config["quantization"] = {
        "group_size": recipe.default_group_size if recipe.default_bits else first_group,
        "bits": recipe.default_bits or first_bits,
        "mode": "affine",
        **{p: {"bits": b, "group_size": g} for p, (b, g) in plan.items()},
    }
    config["qwen3_tts_recipe"] = recipe.name
    if recipe.vocoder_dtype:
        config["qwen3_tts_vocoder_dtype"] = recipe.vocoder_dtype
    config.update(extra or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dst)


def quantize_checkpoint(src: Path, dst: Path, recipe: Recipe, *, progress: bool = True) -> dict:
    """Write `src` quantized with `recipe` (round to nearest) to `dst`; returns the plan.

    Mirrors `mlx_audio.convert`: build the model, sanitize and load the weights, quantize the
    planned modules, save in mlx-audio's format.
    """
    model = load_full_precision(src)
    plan = apply_recipe(model, recipe)
    save_quantized(model, src, dst, plan, recipe, progress=progress)
    return plan


def prepare(source: ModelSource, *, progress: bool = True) -> tuple[Path, bool]:
    """Directory to load for `source` (quantizing into the cache when needed); True if cached."""
    path = fetch(source)
    if source.quantize_with is None:
        return path, False
    dst = quantized_cache_dir(path, source.quantize_with)
    if (dst / "config.json").is_file():
        return dst, True
    t0 = time.perf_counter()
    plan = quantize_checkpoint(path, dst, source.quantize_with, progress=progress)
    logger.info(
        "quantized %s with %s (%d modules) in %.1fs -> %s",
        path, source.quantize_with.name, len(plan), time.perf_counter() - t0, dst,
    )  # fmt: skip
    return dst, False


def _load_predicate(path: str, module) -> bool:
    # mlx-audio's Model.model_quant_predicate refuses the embeddings even where config.json lists
    # them as quantized; what is quantized is then decided by config.json (per-module entries, or
    # the scales in the weights), as mlx-audio's apply_quantization does for every other module.
    return not any(s in path for s in ALWAYS_SKIPPED)


def compute_talker_in(model, dtype: str) -> None:
    """The talker and code predictor compute in `dtype`: their floating weights (quantized
    modules' scales and biases included) cast once, so activations and the KV cache follow.
    Embedding tables keep their dtype (a lookup costs nothing; the first matmul promotes what
    it reads), so the largest tables of the real model do not double.

    For mlx's CPU backend: its bfloat16 matmul is a plain loop whose cost grows with every row
    of a batch, while float32 runs on BLAS (measured on the tiny checkpoint: a 64x64 matmul
    7/13/21 us at 1/4/8 rows in bfloat16, 3/5/5 us in float32). The cast weights take twice
    the memory of bfloat16."""
    target = getattr(mx, dtype)
    for _, module in model.talker.named_modules():
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            continue
        for key, value in list(module.items()):  # its own arrays, one at a time (a low peak)
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                module[key] = value.astype(target)
                mx.eval(module[key])


def resolve_compute_dtype(dtype: str | None) -> str | None:
    """The dtype a talker asked to compute in `dtype` computes in: "auto" is float32 on mlx's
    CPU backend (see `compute_talker_in`) and the weights' own dtype (None) on a GPU."""
    check_compute_dtype(dtype)
    if dtype != AUTO_COMPUTE:
        return dtype
    return "float32" if on_cpu() else None


def load_checkpoint(
    path: Path, *, keep_encoder: bool | None = None, compute_dtype: str | None = None
):
    """A local Qwen3-TTS checkpoint as an mlx-audio Model with its tokenizers.

    The steps of mlx-audio's `load_model`, except that quantized embeddings load (mlx-audio's own
    loader cannot read a checkpoint whose embeddings a recipe quantized). The speech tokenizer's
    encoder (~225 MB in float32 for the real model) is only used to clone a voice from reference
    audio, which only Base models do: it is dropped for the others unless `keep_encoder`.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    path = Path(path)
    # transformers warns "a model of type `qwen3_tts` ... of type ``" on every load of a correct
    # checkpoint (mlx-audio reads a sub-config through a generic class): noise, not a problem.
    logging.getLogger("transformers.configuration_utils").setLevel(logging.ERROR)
    config = load_config(path)
    config["model_path"] = str(path)
    model = Model(ModelConfig.from_dict(config))
    weights = model.sanitize(load_weights(path))
    apply_quantization(model, config, weights, _load_predicate)
    model.load_weights(list(weights.items()))
    del weights
    mx.eval(model.parameters())
    model.eval()
    # mlx-audio prints progress to stdout; keep stdout clean for `--json` output.
    with contextlib.redirect_stdout(sys.stderr):
        model = Model.post_load_hook(model, path)
    if model.tokenizer is None or model.speech_tokenizer is None:
        raise RuntimeError(f"{path}: the text tokenizer or speech tokenizer failed to load")
    if keep_encoder is None:
        keep_encoder = config.get("tts_model_type") == "base"
    if not keep_encoder:
        model.speech_tokenizer.encoder_model = None
    if config.get("qwen3_tts_vocoder_dtype"):
        cast_vocoder(model, config["qwen3_tts_vocoder_dtype"])
    if compute_dtype is not None:
        compute_talker_in(model, compute_dtype)
    if on_cpu():  # mlx's CPU kernels for the vocoder's convolutions are slow (cpu_kernels.py)
        use_fast_cpu_kernels(model.speech_tokenizer)
    release_freed_memory()
    return model


def load(source: ModelSource, *, progress: bool = True, compute_dtype: str | None = None):
    """Load the mlx-audio model for `source` (its talker computing in `compute_dtype`, None:
    the weights' dtype; "auto": see `resolve_compute_dtype`). Returns (model, details), the
    details naming the dtype the talker computes in."""
    compute_dtype = resolve_compute_dtype(compute_dtype)  # before a download
    t0 = time.perf_counter()
    path, cached = prepare(source, progress=progress)
    model = load_checkpoint(path, compute_dtype=compute_dtype)
    return model, {
        "path": str(path),
        "from_cache": cached,
        "quantized_on_load": source.quantize_with is not None and not cached,
        "load_s": time.perf_counter() - t0,
        "compute_dtype": compute_dtype,
    }


def quantized_modules(model) -> dict[str, int]:
    """Module path -> bits for every quantized module of a loaded model."""
    return {
        path: m.bits
        for path, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }


def component_paths(model, component: str) -> list[str]:
    """The quantizable module paths of a loaded model that an ablation `component` names."""
    r = component_rule(component, 8)
    n = model.config.talker_config.num_hidden_layers
    return sorted(p for p, _ in quantizable_modules(model) if r.matches(p, n))


def describe(model) -> dict:
    """What the server and the rule book (`rules.ModelInfo`) know of a loaded model."""
    talker = model.config.talker_config
    return {
        "tts_model_type": model.config.tts_model_type,
        "tts_model_size": model.config.tts_model_size,
        "voices": sorted((talker.spk_id or {}).keys()),
        "languages": ["auto", *sorted((talker.codec_language_id or {}).keys())],
        "sample_rate": model.sample_rate,
        "can_clone": model.speech_tokenizer is not None and model.speech_tokenizer.has_encoder,
    }
