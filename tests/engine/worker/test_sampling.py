"""The batched sampler draws what the plain filters over the whole vocabulary would draw.

`BatchSampler` draws a row with top-k from a pool of candidates only (the batch's largest k +
16 ids: one argpartition, then the filters, softmax and the inverse CDF over the pool). The
reference here is the textbook computation in numpy over the whole vocabulary, in id order:
suppressed ids, repetition penalty, temperature, top-k keeping ties at the k-th value, top-p
(mlx-lm's rule), then the first id whose cumulative probability passes the row's uniform
number.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qwen3_tts_engine.worker.sampling import (
    BatchSampler,
    SamplingParams,
    frame_uniforms,
    presence_mask,
)

VOCAB = 2048


def _reference(
    logits: np.ndarray, u: float, p: SamplingParams, suppress=None, presence=None
) -> int:
    x = logits.astype(np.float64)
    if suppress is not None:
        x = np.where(suppress, -np.inf, x)
    if presence is not None:
        x = np.where(
            presence, np.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x
        )
    if p.temperature <= 0 or p.top_k == 1:
        return int(np.argmax(x))
    x = x / p.temperature
    if 0 < p.top_k < len(x):
        kth = np.sort(x)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    if 0 < p.top_p < 1:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(probs)
        cumulative = np.empty_like(probs)
        cumulative[order] = np.cumsum(probs[order])
        x = np.where(cumulative > 1 - p.top_p, x, -np.inf)
    probs = np.exp(x - x.max())
    cdf = np.cumsum(probs / probs.sum())
    return int(np.argmax(cdf > u * cdf[-1]))


PARAMS = [
    SamplingParams(),  # top-k 50, the default
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.2, top_k=5, top_p=0.8),
    SamplingParams(top_k=0, top_p=0.9),  # no top-k: the whole vocabulary
    SamplingParams(temperature=0.0),  # greedy
    SamplingParams(top_k=1),  # greedy as well
]


def _logits(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # distinct values (a permutation), scaled like real logits
    return np.stack([rng.permutation(VOCAB).astype(np.float32) / 256.0 - 4.0 for _ in range(rows)])


@pytest.mark.parametrize("rows", [
    [0], [0, 1], [1, 2], [0, 1, 2, 4], [3], [0, 3, 5], list(range(len(PARAMS))),
], ids=lambda r: "+".join(map(str, r)))  # fmt: skip
def test_batched_draws_equal_the_whole_vocabulary_reference(rows):
    params = [PARAMS[i] for i in rows]
    sampler = BatchSampler(params, VOCAB)
    rng = np.random.default_rng(len(rows))
    for trial in range(40):
        logits = _logits(len(rows), seed=trial * 10 + len(rows))
        u = rng.random(len(rows)).astype(np.float32)
        got = np.array(sampler.sample(mx.array(logits), mx.array(u)))[:, 0]
        want = [_reference(logits[b], float(u[b]), p) for b, p in enumerate(params)]
        assert got.tolist() == want, (trial, params)


@pytest.mark.parametrize("vocab", [60, 66, 67])  # the pool (k + 16 = 66) at or over the vocabulary
def test_a_pool_as_large_as_the_vocabulary_filters_the_whole_of_it(vocab):
    params = [SamplingParams(), SamplingParams(top_k=5, top_p=0.9)]
    sampler = BatchSampler(params, vocab)
    rng = np.random.default_rng(vocab)
    for trial in range(30):
        logits = rng.permutation(vocab).astype(np.float32)[None].repeat(2, 0) / 16.0
        u = rng.random(2).astype(np.float32)
        got = np.array(sampler.sample(mx.array(logits), mx.array(u)))[:, 0].tolist()
        assert got == [_reference(logits[b], float(u[b]), p) for b, p in enumerate(params)], trial


def test_a_greedy_row_without_top_k_leaves_the_others_on_their_pool():
    params = [SamplingParams(temperature=0.0, top_k=0), SamplingParams(top_k=20)]
    sampler = BatchSampler(params, VOCAB)
    assert sampler.pool == 20 + 16  # not the whole vocabulary for the greedy row's sake
    rng = np.random.default_rng(11)
    for trial in range(30):
        logits = _logits(2, seed=500 + trial)
        u = rng.random(2).astype(np.float32)
        got = np.array(sampler.sample(mx.array(logits), mx.array(u)))[:, 0].tolist()
        assert got == [_reference(logits[b], float(u[b]), p) for b, p in enumerate(params)], trial


def test_suppressed_ids_and_the_repetition_penalty_as_the_reference():
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(top_k=20, repetition_penalty=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0)]  # fmt: skip
    suppress = np.zeros(VOCAB, np.bool_)
    suppress[VOCAB - 1024 :] = True
    sampler = BatchSampler(params, VOCAB)
    rng = np.random.default_rng(7)
    drawn_suppressed = 0
    for trial in range(40):
        logits = _logits(len(params), seed=1000 + trial)
        top = np.argsort(logits, axis=1)[:, -30:]  # recent tokens among the likely ones
        histories = [rng.choice(t, size=8).tolist() for t in top]
        presence = np.array(presence_mask(histories, VOCAB))
        u = rng.random(len(params)).astype(np.float32)
        got = np.array(sampler.sample(mx.array(logits), mx.array(u), suppress=mx.array(suppress),
                                      presence=mx.array(presence)))[:, 0]  # fmt: skip
        want = [
            _reference(logits[b], float(u[b]), p, suppress, presence[b])
            for b, p in enumerate(params)
        ]
        assert got.tolist() == want, trial
        drawn_suppressed += int((got >= VOCAB - 1024).sum())
    assert drawn_suppressed == 0


def test_a_row_draws_the_same_alone_and_in_a_batch():
    """A row's draw depends on its own logits, settings and number only, not on the other
    rows' top-k (what makes a seeded stream repeat itself batched), also with bfloat16 logits,
    which tie at the k-th value often."""
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(top_p=0.8), SamplingParams(temperature=1.1, top_k=7)]  # fmt: skip
    rng = np.random.default_rng(3)
    ties = 0
    for trial in range(100):
        logits = mx.array(rng.standard_normal((len(params), VOCAB)).astype(np.float32) * 3).astype(
            mx.bfloat16
        )
        u = mx.array(rng.random(len(params)).astype(np.float32))
        together = np.array(BatchSampler(params, VOCAB).sample(logits, u))[:, 0].tolist()
        alone = [int(np.array(BatchSampler([p], VOCAB).sample(logits[b : b + 1], u[b : b + 1]))[0, 0])
                 for b, p in enumerate(params)]  # fmt: skip
        values = np.array(logits.astype(mx.float32))
        assert together == alone, trial
        # and the whole vocabulary's draw (not for top-p, where the order of tied
        # probabilities decides which of them reach the mass)
        want = [_reference(values[b], float(u[b]), p) for b, p in enumerate(params)]
        plain = [b for b, p in enumerate(params) if p.top_p == 1.0]
        assert [together[b] for b in plain] == [want[b] for b in plain], trial
        kth = [np.sort(values[b])[-p.top_k] for b, p in enumerate(params)]
        ties += sum(int((values[b] == kth[b]).sum() > 1) for b in range(len(params)))
    assert ties > 10  # the case this is about did occur


def test_frame_uniforms_are_each_keys_own_numbers():
    """The batched draw gives every row what its key alone gives (split, then uniform)."""
    keys = [mx.random.key(seed) for seed in (1, 2, 3)]
    next_keys, numbers = frame_uniforms(keys, 16)
    for b, key in enumerate(keys):
        nxt, sub = mx.random.split(key)
        assert mx.array_equal(next_keys[b], nxt)
        np.testing.assert_array_equal(
            np.array(numbers[b]), np.array(mx.random.uniform(shape=(16,), key=sub))
        )
