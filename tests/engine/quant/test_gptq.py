"""GPTQ in MLX's affine format: lower output error than round-to-nearest, and the exact packing,
scales and biases `mx.quantize` makes, so the result is a plain nn.QuantizedLinear."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from qwen3_tts_engine.quant.gptq import (
    HessianRecorder,
    apply_gptq,
    attach_recorders,
    dequantize,
    detach_recorders,
    gptq_quantize,
    pack,
    quantize_linear_gptq,
    rtn_quantize,
)


def _data(seed: int = 0, out_dims: int = 96, in_dims: int = 256, tokens: int = 2048):
    """A weight [out, in] and correlated inputs X = Z @ A [tokens, in]."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_dims, in_dims)) * 0.05).astype(np.float32)
    x = rng.standard_normal((tokens, in_dims)) @ (rng.standard_normal((in_dims, in_dims)) / 16)
    return w, x


def _rel_output_error(w: np.ndarray, w_hat: np.ndarray, x: np.ndarray) -> float:
    """||(W - Ŵ) X^T||² / ||W X^T||²."""
    return float(np.sum(((w - w_hat) @ x.T) ** 2) / np.sum((w @ x.T) ** 2))


def _errors(bits: int, group_size: int = 64) -> tuple[float, float]:
    w, x = _data()
    h = x.T @ x / len(x)
    rtn = dequantize(*rtn_quantize(w, bits, group_size), bits, group_size)
    gptq = dequantize(*gptq_quantize(w, h, bits=bits, group_size=group_size), bits, group_size)
    return _rel_output_error(w, rtn, x), _rel_output_error(w, gptq, x)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(bits):
    rtn, gptq = _errors(bits)
    print(f"\n{bits}-bit group 64: output error RTN {rtn:.3e}, GPTQ {gptq:.3e} ({gptq / rtn:.2f}x)")
    assert gptq < 0.8 * rtn


def test_at_8_bits_both_errors_are_tiny():
    rtn, gptq = _errors(8)
    print(f"\n8-bit group 64: output error RTN {rtn:.3e}, GPTQ {gptq:.3e}")
    assert gptq < rtn < 1e-4


def _codes(w_q: mx.array, shape: tuple[int, int], bits: int, group_size: int) -> np.ndarray:
    """The integer codes, read back by dequantizing with scale 1 and bias 0."""
    ones = mx.ones((shape[0], shape[1] // group_size))
    return np.array(mx.dequantize(w_q, ones, 0 * ones, group_size, bits)).astype(np.int64)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_what_mlx_expects(bits):
    w, x = _data(seed=1)
    w_q, scales, biases = gptq_quantize(w, x.T @ x / len(x), bits=bits, group_size=64)
    assert (w_q.dtype, w_q.shape) == (mx.uint32, (96, 256 * bits // 32))
    assert scales.dtype == biases.dtype == mx.float32 and scales.shape == biases.shape == (96, 4)
    q = _codes(w_q, w.shape, bits, 64)
    assert q.min() >= 0 and q.max() <= 2**bits - 1
    assert np.array_equal(np.array(pack(q, bits)), np.array(w_q))
    s, b = (np.repeat(np.array(a), 64, axis=1) for a in (scales, biases))
    w_hat = dequantize(w_q, scales, biases, bits, 64)
    np.testing.assert_allclose(w_hat, s * q + b, rtol=1e-6, atol=1e-7)

    ql = nn.QuantizedLinear(256, 96, bias=False, group_size=64, bits=bits)
    ql.weight, ql.scales, ql.biases = w_q, scales, biases
    xs = x[:8].astype(np.float32)
    np.testing.assert_allclose(np.array(ql(mx.array(xs))), xs @ w_hat.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_rtn_is_mx_quantize_and_gptq_with_identity_hessian_equals_it(bits):
    w, _ = _data(seed=2)
    rtn = rtn_quantize(w, bits, 64)
    for mine, theirs in zip(rtn, mx.quantize(mx.array(w), 64, bits), strict=True):
        assert np.array(mine).tobytes() == np.array(theirs).tobytes()
    # uncorrelated inputs: no error to propagate, and damping only scales the diagonal
    identity = gptq_quantize(w, np.eye(256), bits=bits, group_size=64)
    for mine, theirs in zip(identity, rtn, strict=True):
        assert np.array(mine).tobytes() == np.array(theirs).tobytes()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_group_sizes(group_size):
    w, x = _data(seed=3)
    w_q, scales, _ = gptq_quantize(w, x.T @ x / len(x), bits=4, group_size=group_size)
    assert w_q.shape == (96, 32) and scales.shape == (96, 256 // group_size)


def test_invalid_shapes_and_settings_raise():
    w, x = _data(seed=4, in_dims=96)
    h = x.T @ x / len(x)
    with pytest.raises(ValueError, match="multiple of 64"):
        gptq_quantize(w, h, bits=4, group_size=64)
    with pytest.raises(ValueError, match="multiple of 64"):
        rtn_quantize(w, 4, 64)
    with pytest.raises(ValueError, match="bits=7"):
        gptq_quantize(w, h, bits=7, group_size=32)
    with pytest.raises(ValueError, match="group_size=16"):
        gptq_quantize(w, h, bits=4, group_size=16)


def test_dead_inputs_are_handled():
    w, x = _data(seed=5)
    x[:, :10] = 0.0  # inputs that never fire: zero rows/columns in H
    w_q, scales, biases = gptq_quantize(w, x.T @ x / len(x), bits=4, group_size=64)
    assert np.isfinite(dequantize(w_q, scales, biases, 4, 64)).all()


class MLP(nn.Module):
    def __init__(self, dims: int = 64, hidden: int = 128):
        super().__init__()
        self.up_proj = nn.Linear(dims, hidden)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def __call__(self, x):
        return x + self.mlp(x)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [Block(), Block()]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


PATHS = [f"layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("up", "down")]


def _tiny_and_inputs(seed: int = 0):
    mx.random.seed(seed)
    model = Tiny()
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((64, 64)) / 8 * np.exp(rng.uniform(-1.5, 1.5, 64))  # uneven scales
    inputs = lambda n: mx.array((rng.standard_normal((n, 64)) @ mix).astype(np.float32))  # noqa: E731
    return model, inputs


def test_recorders_see_the_inputs_and_detach_restores_the_modules():
    model, inputs = _tiny_and_inputs()
    assert set(PATHS) <= {p for p, _ in model.named_modules()}
    x = inputs(512)
    expected = model(x)
    originals = {p: m for p, m in model.named_modules() if p in PATHS}

    recorders = attach_recorders(model, PATHS)
    assert isinstance(model.layers[1].mlp.down_proj, HessianRecorder)
    out = model(x.reshape(4, 128, 64))  # leading dims are flattened into tokens
    np.testing.assert_array_equal(np.array(out).reshape(512, 64), np.array(expected))
    first = recorders["layers.0.mlp.up_proj"]
    assert first.tokens == 512 and first.hessian.dtype == np.float64
    xn = np.array(x, dtype=np.float64)
    np.testing.assert_allclose(first.hessian, xn.T @ xn / 512, rtol=1e-5, atol=1e-6)

    detach_recorders(model, recorders)
    assert all(dict(model.named_modules())[p] is m for p, m in originals.items())
    with pytest.raises(ValueError, match="not an nn.Linear"):
        attach_recorders(model, ["layers.0.mlp"])


def test_apply_gptq_beats_rtn_on_held_out_inputs():
    model, inputs = _tiny_and_inputs(seed=1)
    reference, rtn = Tiny(), Tiny()
    reference.update(model.parameters())
    rtn.update(model.parameters())
    nn.quantize(rtn, group_size=32, bits=3, class_predicate=lambda p, m: p in PATHS)

    batches = [inputs(1024) for _ in range(2)]
    stats = apply_gptq(model, PATHS, lambda m: [m(b) for b in batches],
                       bits=3, group_size=32, progress=False)  # fmt: skip
    assert [s["path"] for s in stats] == PATHS
    assert all(s["gptq_error"] < s["rtn_error"] for s in stats)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[p], nn.QuantizedLinear) for p in PATHS)
    assert modules["layers.0.mlp.up_proj"].bits == 3 and "bias" in modules["layers.0.mlp.up_proj"]
    assert "bias" not in modules["layers.0.mlp.down_proj"]

    held_out = inputs(2048)
    want = np.array(reference(held_out))
    err = {name: float(np.mean((np.array(m(held_out)) - want) ** 2)) for name, m in
           (("rtn", rtn), ("gptq", model))}  # fmt: skip
    print(
        f"\nheld-out output MSE: RTN {err['rtn']:.3e}, GPTQ {err['gptq']:.3e}; per layer "
        + ", ".join(f"{s['rtn_error']:.3f}->{s['gptq_error']:.3f}" for s in stats)
    )
    assert err["gptq"] < err["rtn"]


def test_quantize_linear_gptq_keeps_the_bias_and_reports_errors():
    model, inputs = _tiny_and_inputs(seed=2)
    x = np.array(inputs(1024), dtype=np.float64)
    stats = quantize_linear_gptq(
        model, "layers.0.mlp.up_proj", x.T @ x / len(x), bits=4, group_size=64
    )
    assert set(stats) == {"path", "bits", "group_size", "rtn_error", "gptq_error"}
    assert 0 < stats["gptq_error"] < stats["rtn_error"]
    assert isinstance(model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert model.layers[0].mlp.up_proj.bias.shape == (128,)


def test_apply_gptq_refuses_layers_calibration_never_reached():
    model, _ = _tiny_and_inputs()
    with pytest.raises(ValueError, match="never reached layers.0.mlp.up_proj"):
        apply_gptq(model, PATHS, lambda m: None, bits=4, group_size=32, progress=False)
    assert all(isinstance(m, nn.Linear) for p, m in model.named_modules() if p in PATHS)


def test_gptq_checkpoint_loads_into_a_plainly_quantized_model(tmp_path):
    from mlx.utils import tree_flatten

    model, inputs = _tiny_and_inputs(seed=3)
    apply_gptq(model, PATHS, lambda m: m(inputs(512)), bits=4, group_size=64, progress=False)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    fresh = Tiny()  # what a loader does: quantize the skeleton, then load the weights strictly
    nn.quantize(fresh, group_size=64, bits=4, class_predicate=lambda p, m: p in PATHS)
    fresh.load_weights(str(tmp_path / "model.safetensors"), strict=True)
    x = inputs(16)
    np.testing.assert_array_equal(np.array(fresh(x)), np.array(model(x)))


def test_bf16_linear_gets_bf16_scales_like_from_linear():
    model, inputs = _tiny_and_inputs(seed=4)
    model.set_dtype(mx.bfloat16)
    x = np.array(inputs(1024), dtype=np.float64)
    quantize_linear_gptq(model, "layers.0.mlp.up_proj", x.T @ x / len(x), bits=4, group_size=64)
    ql = model.layers[0].mlp.up_proj
    like = nn.QuantizedLinear.from_linear(model.layers[1].mlp.up_proj, group_size=64, bits=4)
    for name in ("weight", "scales", "biases", "bias"):
        assert (ql[name].dtype, ql[name].shape) == (like[name].dtype, like[name].shape)
