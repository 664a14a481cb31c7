"""Variant footprints: the memory one worker of a variant takes, measured or else estimated.

Measured: the worker's RSS after warm-up and while serving (the largest seen). Before a variant
has run, it is estimated from a measured one plus the difference in weight bytes, which come from
the checkpoint's safetensors headers and the variant's recipe (no weights are read).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from qwen3_tts_engine.models.recipes import Recipe, get_recipe, quantization_plan

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U32": 4, "I32": 4, "I64": 8, "U8": 1,
               "I8": 1, "BOOL": 1}  # fmt: skip
Tensors = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, safetensors dtype)
FLOATS = ("BF16", "F16", "F32")
COMPUTE_BYTES = {"float32": 4}  # per value, for each of protocol.COMPUTE_DTYPES


def read_safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def estimate_weight_bytes(tensors: Tensors, recipe: Recipe, num_talker_layers: int,
                          compute_dtype: str | None = None) -> int:  # fmt: skip
    """Bytes of `tensors` (full precision) once quantized with `recipe`, as mlx stores them:
    packed weights plus one scale and one bias per group, in the weight's dtype. With a
    `compute_dtype` (float32), the talker's floating tensors other than its embedding tables
    take its size, as `loading.compute_talker_in` casts them."""
    modules = [(name.removesuffix(".weight"), shape[-1]) for name, (shape, _) in tensors.items()
               if name.endswith(".weight") and len(shape) == 2]  # Linear / Embedding  # fmt: skip
    plan = quantization_plan(recipe, modules, num_talker_layers)
    total = 0
    for name, (shape, dtype) in tensors.items():
        n, size = math.prod(shape), DTYPE_BYTES.get(dtype, 2)
        module = name.removesuffix(".weight")
        if (
            compute_dtype
            and dtype in FLOATS
            and name.startswith("talker.")
            and "embedding" not in module
        ):
            size = COMPUTE_BYTES[compute_dtype]
        if name.endswith(".weight") and module in plan:
            bits, group = plan[module]
            total += n * bits // 8 + 2 * (n // group) * size
        else:
            total += n * size
    return total


def vocoder_bytes(tensors: Tensors, recipe: Recipe) -> int:
    """Bytes of the speech tokenizer's decoder (`tensors`: its safetensors headers) once loaded
    for `recipe`, which may cast it to 16 bits."""
    total = 0
    for name, (shape, dtype) in tensors.items():
        if name.startswith("decoder."):
            size = DTYPE_BYTES.get(dtype, 4)
            total += math.prod(shape) * (min(size, 2) if recipe.vocoder_dtype else size)
    return total


def checkpoint_weight_bytes(model_dir: Path, variants: Iterable[str],
                            compute_dtype: str | None = None) -> dict[str, int]:  # fmt: skip
    """Estimated weight bytes per variant of a local full-precision checkpoint ({} otherwise):
    the root weights as each recipe quantizes them (the talker computing in `compute_dtype`)
    plus the vocoder in each recipe's dtype."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("quantization") or config.get("quantization_config"):
            return {}  # pre-quantized: only its own variant loads, and that one gets measured
        tensors: dict = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            tensors.update(read_safetensors_header(f))
        vocoder: dict = {}
        for f in sorted(model_dir.glob("speech_tokenizer/*.safetensors")):
            vocoder.update(read_safetensors_header(f))
        layers = config["talker_config"]["num_hidden_layers"]
        return {v: estimate_weight_bytes(tensors, get_recipe(v), layers, compute_dtype)
                + vocoder_bytes(vocoder, get_recipe(v)) for v in variants}  # fmt: skip
    except (OSError, KeyError, ValueError):
        return {}


def breakdown(parts: Mapping[str, int] | None, memory: Mapping[str, int]) -> dict:
    """A worker's process memory (`memory`: its RSS and mlx counters) split into what it is made
    of: the weights by part (`parts`: `model_bytes` + `kv_bytes_per_frame`, from the worker's
    load), and the runtime, i.e. everything else (interpreter, libraries, mlx's buffer cache,
    activations, the KV caches of the streams in flight)."""
    parts = parts or {}
    rss = memory.get("rss_bytes")
    weights = {k: parts[k] for k in ("talker_bytes", "speech_tokenizer_bytes", "speaker_encoder_bytes")
               if parts.get(k) is not None}  # fmt: skip
    return {
        "process_bytes": rss, **weights,
        "runtime_bytes": rss - sum(weights.values()) if rss and weights else None,
        "kv_bytes_per_frame": parts.get("kv_bytes_per_frame"),
        "mlx_cache_bytes": memory.get("mlx_cache_bytes"),
    }  # fmt: skip


class Footprints:
    """Per-variant worker memory in bytes: measured where a worker has run, else estimated."""

    def __init__(self, weight_bytes: Mapping[str, int] | None = None) -> None:
        self.weight_bytes = dict(weight_bytes or {})
        self.measured: dict[str, int] = {}
        self.parts: dict[str, dict] = {}  # the largest measurement's breakdown
        self._weights: dict[str, Mapping[str, int]] = {}  # a worker's `footprint` info

    def observe(self, variant: str | None, memory: Mapping[str, int],
                parts: Mapping[str, int] | None = None) -> None:  # fmt: skip
        """A worker of `variant` uses `memory`; `parts` is its load-time breakdown, if known."""
        if not variant:
            return
        if parts:
            self._weights[variant] = parts
        rss = memory.get("rss_bytes")
        if rss and rss >= self.measured.get(variant, 0):
            self.measured[variant] = rss
            self.parts[variant] = breakdown(self._weights.get(variant), memory)

    def get(self, variant: str) -> int | None:
        if variant in self.measured:
            return self.measured[variant]
        if variant not in self.weight_bytes:
            return None
        known = [m for m in self.measured if m in self.weight_bytes]
        if not known:
            return None
        # Conservative: the largest estimate over the measured variants.
        return max(
            self.measured[m] + self.weight_bytes[variant] - self.weight_bytes[m] for m in known
        )

    def as_dict(self, variants: Iterable[str]) -> dict:
        return {v: {"bytes": self.get(v), "measured": v in self.measured,
                    "weight_bytes": self.weight_bytes.get(v), "parts": self.parts.get(v)}
                for v in variants}  # fmt: skip
