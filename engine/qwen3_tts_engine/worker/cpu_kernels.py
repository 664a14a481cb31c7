"""The speech tokenizer on mlx's CPU backend: its convolutions as matrix products, its Snake
activations with a square in place of a power.

mlx's CPU convolution takes a slow generic path for dilated kernels and for transposed
convolutions, and the vocoder is made of both: its residual units are dilated (1, 3, 9) and its
upsamplers are transposed convolutions. Measured on the tiny decoder, one 4-frame chunk (7680
samples): a dilation-9 convolution 650 ms, the same sum as one matmul 10 ms; a stride-30
transposed convolution 365 ms, as a matmul and an overlap-add 13 ms. On the CPU, the modules
compute that way (BLAS runs the matmuls):

- `nn.Conv1d` (stride 1, one group): im2col, the K shifted (dilated) views of the input side by
  side, times the weight as one [K * C_in, C_out] matrix;
- `nn.ConvTranspose1d` (one group, no dilation, no output padding): every input frame times the
  weight gives its K output taps; taps are added where frames overlap (a stride apart).

The Snake activations (x + sin²(αx) / β, after every convolution of the decoder) square with
`mx.power(s, 2)`, a general power; `mx.square` is the same value (to float rounding) at half the
activation's cost. With both, a tiny-vocoder chunk takes ~0.1 s here instead of ~1.35 s.

The results equal mlx's kernels' to float rounding (tests/engine/worker/test_cpu_kernels.py). The modules keep
their weights and their place in the model (only their class changes), so loading, casting and
the vocoder's streaming state are untouched; other devices keep mlx's kernels.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import DecoderOutputSnake, SnakeBeta


class MatmulConv1d(nn.Conv1d):
    """`nn.Conv1d` (stride 1, groups 1) as im2col and one matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        cout, k, cin = self.weight.shape
        d = self.dilation
        frames = x.shape[1] + 2 * self.padding - (k - 1) * d
        if frames <= 0:  # shorter than the kernel's reach: mlx's own kernel says what that is
            return super().__call__(x)
        if self.padding:
            x = mx.pad(x, [(0, 0), (self.padding, self.padding), (0, 0)])
        cols = (
            x
            if k == 1
            else mx.concatenate([x[:, i * d : i * d + frames] for i in range(k)], axis=-1)
        )
        y = cols @ self.weight.reshape(cout, k * cin).T
        return y + self.bias if "bias" in self else y


class MatmulConvTranspose1d(nn.ConvTranspose1d):
    """`nn.ConvTranspose1d` (groups 1, dilation 1, output padding 0) as a matmul and an
    overlap-add."""

    def __call__(self, x: mx.array) -> mx.array:
        cout, k, cin = self.weight.shape
        s = self.stride
        n = -(-k // s)  # the kernel in n pieces of one stride (zero taps pad the last)
        w = self.weight if n * s == k else mx.pad(self.weight, [(0, 0), (0, n * s - k), (0, 0)])
        b, length, _ = x.shape
        # taps[b, t, j, c]: what input frame t gives output sample t * s + j
        taps = (x @ w.transpose(1, 0, 2).reshape(n * s * cout, cin).T).reshape(
            b, length, n * s, cout
        )
        y = None
        for j in range(n):  # piece j of frame t lands on output block t + j
            piece = mx.pad(
                taps[:, :, j * s : (j + 1) * s], [(0, 0), (j, n - 1 - j), (0, 0), (0, 0)]
            )
            y = piece if y is None else y + piece
        y = y.reshape(b, (length + n - 1) * s, cout)[:, : (length - 1) * s + k]
        if self.padding:
            y = y[:, self.padding : y.shape[1] - self.padding]
        return y + self.bias if "bias" in self else y


def _snake(self, x: mx.array) -> mx.array:
    return x + (1.0 / (mx.exp(self.beta) + self.eps)) * mx.square(mx.sin(x * mx.exp(self.alpha)))


class SquareSnakeBeta(SnakeBeta):
    __call__ = _snake


class SquareDecoderOutputSnake(DecoderOutputSnake):
    __call__ = _snake


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def use_fast_cpu_kernels(module: nn.Module) -> int:
    """Make the plain convolutions under `module` compute as matmuls and its Snake activations
    square (see above); the number of modules changed. Grouped, strided (Conv1d) and dilated
    (ConvTranspose1d) convolutions are left as they are."""
    changed = 0
    for _, m in module.named_modules():
        if type(m) in (SnakeBeta, DecoderOutputSnake):
            m.__class__ = SquareSnakeBeta if type(m) is SnakeBeta else SquareDecoderOutputSnake
            changed += 1
        elif type(m) is nn.Conv1d and m.stride == 1 and m.groups == 1:
            m.__class__ = MatmulConv1d
            changed += 1
        elif (type(m) is nn.ConvTranspose1d and m.dilation == 1 and m.output_padding == 0
              and getattr(m, "groups", 1) == 1):  # fmt: skip
            m.__class__ = MatmulConvTranspose1d
            changed += 1
    return changed
