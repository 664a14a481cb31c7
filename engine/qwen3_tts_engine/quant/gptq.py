"""GPTQ (Frantar et al. 2022) for mlx Linear layers, written in MLX's own affine group format.

The result is a standard `nn.QuantizedLinear` (same packing, scales and biases as `mx.quantize`),
so a GPTQ checkpoint saves and loads with mlx-audio unchanged; only the integer codes differ.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
Quantized = tuple[mx.array, mx.array, mx.array]  # (w_q packed uint32, scales, biases)


class HessianRecorder(nn.Module):
    """Wraps an nn.Linear; forwards unchanged and accumulates H = sum of x^T x over its inputs.

    The sum is a float32 mx array evaluated on each call, so no graph or activation is kept
    alive (and the forward must not run under `mx.compile`); `hessian` is the float64 H / tokens.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        n_in = linear.weight.shape[1]
        self._sum = mx.zeros((n_in, n_in), dtype=mx.float32)  # "_" keeps it out of parameters()
        self.tokens = 0

    def __call__(self, x: mx.array) -> mx.array:
        x2 = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        self._sum = self._sum + x2.T @ x2
        mx.eval(self._sum)
        self.tokens += x2.shape[0]
        return self.linear(x)

    @property
    def hessian(self) -> np.ndarray:
        return np.array(self._sum, dtype=np.float64) / max(self.tokens, 1)


def _locate(model: nn.Module, path: str) -> tuple[dict | list, str | int]:
    """(container, key) of a module path; list indices are path parts, as in named_modules()."""
    obj, (*parents, name) = model, path.split(".")
    for part in parents:
        obj = obj[int(part) if isinstance(obj, list) else part]
    return obj, int(name) if isinstance(obj, list) else name


def get_module(model: nn.Module, path: str) -> nn.Module:
    parent, key = _locate(model, path)
    return parent[key]


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, key = _locate(model, path)
    parent[key] = module  # an nn.Module is a dict of its children


def attach_recorders(model: nn.Module, paths: list[str]) -> dict[str, HessianRecorder]:
    """Replace each nn.Linear at a module path (as in `model.named_modules()`) by a recorder."""
    recorders = {}
    for path in paths:
        linear = get_module(model, path)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{path} is a {type(linear).__name__}, not an nn.Linear")
        recorders[path] = HessianRecorder(linear)
        set_module(model, path, recorders[path])
    return recorders


def detach_recorders(model: nn.Module, recorders: dict[str, HessianRecorder]) -> None:
    """Put the original Linears back."""
    for path, recorder in recorders.items():
        set_module(model, path, recorder.linear)


def _check(shape: tuple[int, ...], bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size}; mlx supports {SUPPORTED_GROUP_SIZES}")
    if len(shape) != 2 or shape[1] % group_size:
        raise ValueError(f"weight {shape}: input width must be a multiple of {group_size}")


def rtn_quantize(weight: np.ndarray, bits: int, group_size: int) -> Quantized:
    """Round-to-nearest: plain `mx.quantize` (the baseline). Accepts numpy or mx arrays."""
    _check(tuple(weight.shape), bits, group_size)
    w = mx.array(weight)
    w = w.astype(mx.float32) if w.dtype == mx.float64 else w
    return mx.quantize(w, group_size, bits, mode="affine")


def pack(codes: np.ndarray, bits: int) -> mx.array:
    """Pack integer codes [out, in] the way mx.quantize does: each row is a little-endian
    bitstream (code j at bits [j*bits, (j+1)*bits)), read as little-endian uint32 words."""
    rows, cols = codes.shape
    bitplanes = (codes.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    packed = np.packbits(bitplanes.reshape(rows, cols * bits), axis=1, bitorder="little")
    return mx.array(np.ascontiguousarray(packed).view("<u4").astype(np.uint32))


def dequantize(
    w_q: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int
) -> np.ndarray:
    w = mx.dequantize(w_q, scales, biases, group_size, bits, mode="affine")
    return np.array(w.astype(mx.float32), dtype=np.float64)


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """Upper U with H^-1 = U^T U. With the index order reversed (J, J² = I), J H J = L L^T gives
    H^-1 = (J L^-1 J)^T (J L^-1 J): one Cholesky and one inverse instead of two and one."""
    lower = np.linalg.cholesky(h[::-1, ::-1])
    return np.ascontiguousarray(np.linalg.inv(lower)[::-1, ::-1])


def gptq_quantize(
    weight: np.ndarray,
    hessian: np.ndarray,
    *,
    bits: int,
    group_size: int,
    damp: float = 0.01,
    block_size: int = 128,
    dtype: mx.Dtype = mx.float32,
) -> Quantized:
    """(w_q packed uint32, scales, biases) laid out as `mx.quantize` lays them out.

    weight is [out, in], hessian [in, in]. Groups run along the input dimension; a group's grid
    (scale, bias) is fixed by `mx.quantize` on its error-updated columns when GPTQ reaches its
    first column, then each column is rounded on it and its error spread over the later columns
    with the upper Cholesky factor of the damped inverse Hessian (lazy updates per block).
    Scales/biases come out in `dtype` (the Linear's weight dtype, as `from_linear` would make).
    """
    _check(weight.shape, bits, group_size)
    w = np.array(weight, dtype=np.float64)
    h = np.array(hessian, dtype=np.float64)
    rows, cols = w.shape
    dead = np.diag(h) == 0  # inputs never seen: their columns cannot matter (as in the paper)
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(cols)] += damp * np.mean(np.diag(h))
    u = _upper_cholesky_of_inverse(h)

    n_max = 2**bits - 1
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales, biases = [], []
    block = max(block_size // group_size, 1) * group_size  # so no group straddles two blocks
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2]  # a view: in-block updates land in w
        err = np.zeros((rows, i2 - i1))
        for j in range(i2 - i1):
            if j % group_size == 0:
                group = mx.array(w1[:, j : j + group_size].astype(np.float32)).astype(dtype)
                _, s, b = mx.quantize(group, group_size, bits, mode="affine")
                scales.append(s)
                biases.append(b)
                s32 = np.array(s.astype(mx.float32))[:, 0]
                b32 = np.array(b.astype(mx.float32))[:, 0]
            # float32 arithmetic and round-half-even, exactly as mx.quantize computes its codes
            q = np.clip(np.rint((w1[:, j].astype(np.float32) - b32) / s32), 0, n_max)
            codes[:, i1 + j] = q
            err[:, j] = (w1[:, j] - (s32.astype(np.float64) * q + b32)) / u[i1 + j, i1 + j]
            w1[:, j + 1 :] -= np.outer(err[:, j], u[i1 + j, i1 + j + 1 : i2])
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return pack(codes, bits), mx.concatenate(scales, axis=1), mx.concatenate(biases, axis=1)


def output_error(weight: np.ndarray, approx: np.ndarray, hessian: np.ndarray) -> float:
    """trace((W-Ŵ) H (W-Ŵ)^T) / trace(W H W^T): relative output error on the calibration data."""
    e = weight - approx
    return float(np.sum((e @ hessian) * e) / np.sum((weight @ hessian) * weight))


def quantize_linear_gptq(
    model: nn.Module,
    path: str,
    hessian: np.ndarray,
    *,
    bits: int,
    group_size: int,
    damp: float = 0.01,
) -> dict:
    """Replace the nn.Linear at `path` by an nn.QuantizedLinear holding GPTQ weights.

    Returns {"path", "bits", "group_size", "rtn_error", "gptq_error"}: the Hessian-weighted
    relative output errors of plain RTN and of GPTQ on the same grid settings.
    """
    linear = get_module(model, path)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{path} is a {type(linear).__name__}, not an nn.Linear")
    w = np.array(linear.weight.astype(mx.float32), dtype=np.float64)
    w_q, scales, biases = gptq_quantize(
        w, hessian, bits=bits, group_size=group_size, damp=damp, dtype=linear.weight.dtype
    )
    rtn = rtn_quantize(linear.weight, bits, group_size)
    out_dims, in_dims = w.shape
    ql = nn.QuantizedLinear(in_dims, out_dims, "bias" in linear, group_size, bits, mode="affine")
    ql.weight, ql.scales, ql.biases = w_q, scales, biases
    if "bias" in linear:
        ql.bias = linear.bias
    set_module(model, path, ql)
    return {
        "path": path,
        "bits": bits,
        "group_size": group_size,
        "rtn_error": output_error(w, dequantize(*rtn, bits, group_size), hessian),
        "gptq_error": output_error(w, dequantize(w_q, scales, biases, bits, group_size), hessian),
    }


def apply_gptq(
    model: nn.Module,
    paths: list[str],
    calibrate: Callable[[nn.Module], None],
    *,
    bits: int,
    group_size: int,
    damp: float = 0.01,
    progress: bool = True,
) -> list[dict]:
    """Quantize the Linears at `paths` with GPTQ; returns the per-layer stats.

    Recorders are attached to all `paths`, `calibrate(model)` runs forward passes over the
    calibration data, then each Linear is quantized from its Hessian. All Hessians come from the
    unquantized model in one calibration pass: no sequential re-calibration after each layer
    (the paper's variant), so later layers do not see the earlier layers' quantization error.
    """

    recorders = attach_recorders(model, paths)
    try:
        calibrate(model)
    finally:
        detach_recorders(model, recorders)
    if missing := [p for p, r in recorders.items() if r.tokens == 0]:
        raise ValueError(f"calibration never reached {', '.join(missing)}")
    stats = []
    for path in tqdm(paths, desc=f"GPTQ {bits}-bit", unit="layer", disable=not progress):
        hessian = recorders.pop(path).hessian  # free each Hessian once used (in_dims² each)
        stats.append(quantize_linear_gptq(model, path, hessian, bits=bits, group_size=group_size,
                                          damp=damp))  # fmt: skip
    return stats
