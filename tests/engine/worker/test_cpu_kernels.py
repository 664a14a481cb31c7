"""The speech tokenizer on mlx's CPU backend (worker/cpu_kernels.py): convolutions as matmuls
and Snake activations with a square give the same results as mlx-audio's modules on mlx's own
kernels, module by module and for a whole decode of the tiny checkpoint's vocoder."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import DecoderOutputSnake, SnakeBeta

from qwen3_tts_engine.worker.cpu_kernels import (
    MatmulConv1d,
    MatmulConvTranspose1d,
    SquareDecoderOutputSnake,
    SquareSnakeBeta,
    on_cpu,
    use_fast_cpu_kernels,
)
from qwen3_tts_engine.worker.loading import load_checkpoint


def _both(module: nn.Module, x: mx.array) -> tuple[np.ndarray, np.ndarray]:
    ref = np.array(module(x))
    assert use_fast_cpu_kernels(module) == 1
    return ref, np.array(module(x))


@pytest.mark.parametrize(("cin", "cout", "k", "dilation", "padding", "bias", "frames"), [
    (65, 65, 7, 9, 0, True, 800),  # the residual units' dilations
    (65, 65, 7, 3, 0, True, 300),
    (32, 16, 7, 1, 3, False, 50),  # padded, no bias
    (16, 8, 1, 1, 0, True, 20),  # pointwise
    (8, 8, 7, 9, 0, True, 55),  # one output frame
])  # fmt: skip
def test_conv1d_as_a_matmul_equals_mlx(cin, cout, k, dilation, padding, bias, frames):
    mx.random.seed(cin + k + dilation)
    conv = nn.Conv1d(cin, cout, k, padding=padding, dilation=dilation, bias=bias)
    ref, ours = _both(conv, mx.random.normal((2, frames, cin)))
    assert isinstance(conv, MatmulConv1d) and ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-5)


def test_conv1d_shorter_than_its_kernel_fails_as_mlx_does():
    conv = nn.Conv1d(8, 8, 7, dilation=9)
    use_fast_cpu_kernels(conv)
    with pytest.raises(ValueError, match="cannot be smaller than weight"):
        conv(mx.zeros((1, 40, 8)))


@pytest.mark.parametrize(("cin", "cout", "k", "stride", "padding", "frames"), [
    (130, 65, 60, 30, 0, 64),  # the upsamplers: kernel = 2 x stride
    (64, 32, 32, 16, 0, 16),
    (8, 4, 7, 3, 0, 10),  # kernel not a multiple of the stride
    (8, 4, 6, 2, 1, 5),  # padded
    (8, 4, 2, 2, 0, 1),  # one input frame
])  # fmt: skip
def test_transposed_conv1d_as_a_matmul_equals_mlx(cin, cout, k, stride, padding, frames):
    mx.random.seed(cin + k + stride)
    conv = nn.ConvTranspose1d(cin, cout, k, stride=stride, padding=padding)
    ref, ours = _both(conv, mx.random.normal((2, frames, cin)))
    assert isinstance(conv, MatmulConvTranspose1d) and ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cls", [SnakeBeta, DecoderOutputSnake])
def test_snake_with_a_square_equals_mlx_audios(cls):
    snake = cls(65)
    snake.alpha, snake.beta = mx.random.normal((65,)) * 0.5, mx.random.normal((65,)) * 0.5
    ref, ours = _both(snake, mx.random.normal((2, 500, 65)) * 3)
    assert type(snake) in (SquareSnakeBeta, SquareDecoderOutputSnake)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-6)


def test_grouped_and_strided_convolutions_keep_mlxs_kernels():
    module = nn.Sequential(nn.Conv1d(8, 8, 3, groups=4), nn.Conv1d(8, 8, 4, stride=2),
                           nn.ConvTranspose1d(8, 8, 4, stride=2, dilation=2))  # fmt: skip
    assert use_fast_cpu_kernels(module) == 0
    assert [type(m) for m in module.layers] == [nn.Conv1d, nn.Conv1d, nn.ConvTranspose1d]


@pytest.mark.skipif(not on_cpu(), reason="these kernels are for mlx's CPU backend")
def test_the_loaded_vocoder_decodes_as_with_mlxs_kernels(tiny_checkpoint):
    """A loaded model's speech decoder computes with the matmul convolutions (its dilated
    residual units and transposed upsamplers among them) and the squaring Snakes; its audio for
    random codes equals the audio of the same decoder with mlx-audio's modules."""
    from qwen3_tts_engine.worker.vocoder import windowed_decode

    model = load_checkpoint(tiny_checkpoint())
    decoder = model.speech_tokenizer.decoder
    kinds = {type(m) for _, m in decoder.named_modules()}
    assert MatmulConv1d in kinds and MatmulConvTranspose1d in kinds
    dilated = [m for _, m in decoder.named_modules() if isinstance(m, nn.Conv1d) and m.dilation > 1]
    assert dilated and all(type(m) is MatmulConv1d for m in dilated)

    codes = mx.random.randint(0, 2048, (1, 16, 12), key=mx.random.key(3))
    ours = np.array(windowed_decode(decoder, codes))
    assert {SquareSnakeBeta, SquareDecoderOutputSnake} <= kinds
    for _, m in decoder.named_modules():  # back to mlx-audio's modules
        if type(m) in (
            MatmulConv1d,
            MatmulConvTranspose1d,
            SquareSnakeBeta,
            SquareDecoderOutputSnake,
        ):
            m.__class__ = type(m).__mro__[1]
    ref = np.array(windowed_decode(decoder, codes))
    assert ours.shape == ref.shape and np.abs(ref).max() > 0
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
