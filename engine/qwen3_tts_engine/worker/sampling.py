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
# candidates beyond the largest top-k: ties at a row's k-th value stay in its pool
# (bfloat16 logits tie often; a few ids at a time near the top)
TOP_K_MARGIN = 16


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05


_split = mx.vmap(mx.random.split)
_uniforms = {}  # draws -> the vmapped uniform sampler


def frame_uniforms(keys: list[mx.array], draws: int) -> tuple[list[mx.array], mx.array]:
    """Uniform numbers [B, draws] for one frame of each row, and each row's next key: what
    `mx.random.split` and `mx.random.uniform` give one key, for all rows in a few ops."""
    if draws not in _uniforms:
        _uniforms[draws] = mx.vmap(lambda key: mx.random.uniform(shape=(draws,), key=key))
    split = _split(mx.stack(keys))  # [B, 2, 2]: each row's next key and this frame's key
    return [split[b, 0] for b in range(len(keys))], _uniforms[draws](split[:, 1])


class BatchSampler:
    """The settings of the rows of one step, as [B, 1] arrays built once per batch layout.

    Top-k keeps every id whose value is at least the row's k-th largest (ties included), as a
    filter over the whole vocabulary does. Where every row has a top-k filter (the default,
    k = 50), a row draws from a pool of candidates only: its k + TOP_K_MARGIN largest ids (k:
    the largest of the batch; one `argpartition`, kept in id order), so the filters, softmax and
    inverse CDF run over [B, pool] instead of [B, vocab]. The draw is the one over the whole
    vocabulary unless more than TOP_K_MARGIN ids tie at a row's k-th value, so it does not depend
    on the other rows of the batch either (a seeded stream repeats itself batched). With more
    ties (degenerate logits, many exactly equal), which of the tied ids the pool keeps may
    depend on the batch's largest k.
    """

    def __init__(self, params: list[SamplingParams], vocab: int) -> None:
        self.vocab = vocab
        temps = np.array([p.temperature for p in params], np.float32)
        # greedy: temperature 0, or top-k 1 (the k-th largest filter keeps ties; argmax does not)
        greedy = (temps <= 0) | np.array([p.top_k == 1 for p in params])
        self.any_greedy = bool(greedy.any())
        self.greedy = mx.array(greedy)[:, None]
        self.inv_temp = mx.array(1.0 / np.where(temps > 0, temps, 1.0))[:, None]
        top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int32)
        top_k[greedy] = 1  # a greedy row takes the argmax: it must not widen the others' pool
        # every row filtered: a pool of candidates per row (the largest k plus a margin)
        pool = int(top_k.max()) + TOP_K_MARGIN
        self.pool = pool if (top_k < vocab).all() and pool < vocab else vocab
        self.row_k = mx.array(top_k)[:, None]
        # else: the rows' filters over the whole vocabulary, a partition per distinct k
        self.vocab_top_k = [(int(k), mx.array(top_k == k)[:, None]) for k in np.unique(top_k)
                            if k < vocab] if self.pool == vocab else []  # fmt: skip
        top_p = np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], np.float32)
        self.top_p = mx.array(top_p)[:, None]
        self.use_top_p = bool((top_p < 1).any())
        self.penalty = mx.array(np.array([p.repetition_penalty for p in params], np.float32))[
            :, None
        ]

    def sample(self, logits: mx.array, uniform: mx.array, *, suppress: mx.array | None = None,
               presence: mx.array | None = None) -> mx.array:  # fmt: skip
        """Token ids [B, 1] from logits [B, vocab] and this draw's uniform numbers [B].

        `suppress` [vocab] bool: ids never sampled; `presence` [B, vocab] bool: the ids each
        row generated recently (repetition penalty)."""
        if suppress is not None or presence is not None:
            logits = logits.astype(mx.float32)
        if suppress is not None:
            logits = mx.where(suppress, -mx.inf, logits)
        if presence is not None:
            penalized = mx.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = mx.where(presence, penalized, logits)
        ids = None
        if self.pool < self.vocab:
            # the pool in id order (temperature does not change which ids are the largest), then
            # each row's k-th largest value in it; [B, vocab] sees one argpartition and no more
            ids = mx.argpartition(logits, kth=self.vocab - self.pool, axis=-1)[
                :, self.vocab - self.pool :
            ]
            ids = mx.sort(ids, axis=-1)
            candidates = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32) * self.inv_temp
            descending = -mx.sort(-candidates, axis=-1)
            kth = mx.take_along_axis(descending, self.row_k - 1, axis=-1)
            candidates = mx.where(candidates < kth, -mx.inf, candidates)
        else:
            candidates = logits.astype(mx.float32) * self.inv_temp
        for k, rows in self.vocab_top_k:
            kth = mx.partition(candidates, kth=self.vocab - k, axis=-1)[
                :, self.vocab - k : self.vocab - k + 1
            ]
            candidates = mx.where(rows & (candidates < kth), -mx.inf, candidates)
        if self.use_top_p:
            # as mlx-lm's apply_top_p: keep the ids whose ascending cumulative mass exceeds 1-p
            logprobs = candidates - mx.logsumexp(candidates, axis=-1, keepdims=True)
            order = mx.argsort(logprobs, axis=-1)
            cumulative = mx.cumsum(mx.exp(mx.take_along_axis(logprobs, order, axis=-1)), axis=-1)
            inverse = mx.argsort(order, axis=-1)
            cumulative = mx.take_along_axis(cumulative, inverse, axis=-1)
            candidates = mx.where(cumulative > 1 - self.top_p, candidates, -mx.inf)
        cdf = mx.cumsum(mx.softmax(candidates, axis=-1), axis=-1)
        # the first candidate whose cumulative mass passes u (scaled: the mass may sum to 1 - eps)
        sampled = mx.argmax(cdf > uniform[:, None] * cdf[:, -1:], axis=-1, keepdims=True)
        if ids is not None:
            sampled = mx.take_along_axis(ids, sampled, axis=-1)
        if self.any_greedy:
            sampled = mx.where(self.greedy, mx.argmax(logits, axis=-1, keepdims=True), sampled)
        return sampled.astype(mx.int32)


def presence_mask(histories: list[list[int]], vocab: int) -> mx.array | None:
    """[B, vocab] bool of each row's last REPETITION_CONTEXT tokens; None when all are empty."""
    if not any(histories):
        return None
    mask = np.zeros((len(histories), vocab), np.bool_)
    for row, tokens in enumerate(histories):
        recent = [t for t in tokens[-REPETITION_CONTEXT:] if t < vocab]
        mask[row, recent] = True
    return mx.array(mask)


def eos_suppression(suppress: mx.array, eos: int, allowed: list[bool]) -> mx.array:
    """The ids each row may not sample: `suppress` [vocab] for every row, and the codec EOS for
    rows that may not end yet ([B, vocab]; `suppress` itself when every row may)."""
    if all(allowed):
        return suppress
    block = np.zeros((len(allowed), suppress.shape[0]), np.bool_)
    block[[i for i, ok in enumerate(allowed) if not ok], eos] = True
    return suppress[None, :] | mx.array(block)
