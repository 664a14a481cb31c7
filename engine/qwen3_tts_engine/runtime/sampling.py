"""Per-row token sampling for a batch of streams, each with its own settings and random key.

The same filters as mlx-audio's `_sample_token` (suppressed ids, repetition penalty over the
last 64 codebook-0 tokens, temperature, top-k, top-p) applied to a [B, vocab] batch at once,
with a row's settings as arrays instead of Python scalars. A token is drawn by inverting the
row's cumulative distribution at a uniform number from the row's own key (one number per draw,
not a vocabulary's worth of Gumbel noise): a stream draws the same numbers whether it runs
alone or next to others, so a seeded stream repeats itself (up to float differences of batched
matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

REPETITION_CONTEXT = 64  # mlx-audio's repetition_context_size


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05


def frame_uniforms(keys: list[mx.array], draws: int) -> tuple[list[mx.array], mx.array]:
    """Uniform numbers [B, draws] for one frame of each row, and each row's next key."""
    next_keys, numbers = [], []
    for key in keys:
        key, sub = mx.random.split(key)
        next_keys.append(key)
        numbers.append(mx.random.uniform(shape=(draws,), key=sub))
    return next_keys, mx.stack(numbers)


class BatchSampler:
    """The settings of the rows of one step, as [B, 1] arrays built once per batch layout."""

    def __init__(self, params: list[SamplingParams], vocab: int) -> None:
        self.vocab = vocab
        temps = np.array([p.temperature for p in params], np.float32)
        # greedy: temperature 0, or top-k 1 (the k-th largest filter keeps ties; argmax does not)
        self.greedy = mx.array((temps <= 0) | np.array([p.top_k == 1 for p in params]))[:, None]
        self.inv_temp = mx.array(1.0 / np.where(temps > 0, temps, 1.0))[:, None]
        top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int32)
        # rows by k (usually one group): a partition per distinct k finds each row's k-th largest
        self.top_k = [(int(k), mx.array(top_k == k)[:, None]) for k in np.unique(top_k) if k < vocab]
        top_p = np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], np.float32)
        self.top_p = mx.array(top_p)[:, None]
        self.use_top_p = bool((top_p < 1).any())
        self.penalty = mx.array(np.array([p.repetition_penalty for p in params], np.float32))[:, None]

    def sample(self, logits: mx.array, uniform: mx.array, *, suppress: mx.array | None = None,
               presence: mx.array | None = None) -> mx.array:  # fmt: skip
        """Token ids [B, 1] from logits [B, vocab] and this draw's uniform numbers [B].

        `suppress` [vocab] bool: ids never sampled; `presence` [B, vocab] bool: the ids each
        row generated recently (repetition penalty)."""
        logits = logits.astype(mx.float32)
        if suppress is not None:
            logits = mx.where(suppress, -mx.inf, logits)
        if presence is not None:
            penalized = mx.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = mx.where(presence, penalized, logits)
        greedy = mx.argmax(logits, axis=-1, keepdims=True)
        logits = logits * self.inv_temp
        for k, rows in self.top_k:
            kth = mx.partition(logits, kth=self.vocab - k, axis=-1)[:, self.vocab - k : self.vocab - k + 1]
            logits = mx.where(rows & (logits < kth), -mx.inf, logits)
        if self.use_top_p:
            # as mlx-lm's apply_top_p: keep the ids whose ascending cumulative mass exceeds 1-p
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            order = mx.argsort(logprobs, axis=-1)
            cumulative = mx.cumsum(mx.exp(mx.take_along_axis(logprobs, order, axis=-1)), axis=-1)
            inverse = mx.argsort(order, axis=-1)
            cumulative = mx.take_along_axis(cumulative, inverse, axis=-1)
            logits = mx.where(cumulative > 1 - self.top_p, logits, -mx.inf)
        probs = mx.softmax(logits, axis=-1)
        cdf = mx.cumsum(probs, axis=-1)
        # the first id whose cumulative mass passes u (scaled: the mass may sum to 1 - eps)
        sampled = mx.argmax(cdf > uniform[:, None] * cdf[:, -1:], axis=-1, keepdims=True)
        return mx.where(self.greedy, greedy, sampled).astype(mx.int32)


def presence_mask(histories: list[list[int]], vocab: int) -> mx.array | None:
    """[B, vocab] bool of each row's last REPETITION_CONTEXT tokens; None when all are empty."""
    if not any(histories):
        return None
    mask = np.zeros((len(histories), vocab), np.bool_)
    for row, tokens in enumerate(histories):
        recent = [t for t in tokens[-REPETITION_CONTEXT:] if t < vocab]
        mask[row, recent] = True
    return mx.array(mask)
