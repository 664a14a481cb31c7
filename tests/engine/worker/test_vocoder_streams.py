"""Per-stream vocoder state (worker/vocoder.py): a stream equals the sliding-window one-shot
decode, the window is applied and bounds the KV cache, streams sharing one decoder do not mix.

mlx runs on pytest's main thread here (safe, see docs/mlx-on-linux.md).
"""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizerDecoder

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.worker import vocoder
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.vocoder import (
    decode_step,
    decode_steps,
    new_stream,
    window_mask,
    windowed_decode,
)

ATOL = 2e-4  # as tests/engine/worker/test_synthesis.py


@pytest.fixture(scope="module")
def decoder(tiny_checkpoint):
    """The tiny checkpoint's vocoder as mlx-audio loads it (wrapped in `mx.compile`)."""
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice"))), progress=False)
    return m.speech_tokenizer.decoder


@pytest.fixture(scope="module")
def fast(decoder):
    """The same vocoder with upsample rates [2, 2] instead of [16, 30]: 16 samples a frame.

    On mlx-cpu the tiny vocoder costs ~0.5 s a frame (dilated convolutions at 24 kHz), too slow
    for 300-frame streams. Every weight is the checkpoint's (pre-transformer, quantizer, convs)
    except the two transposed convolutions, whose kernel size follows the rate (random init).
    """
    config = dataclasses.replace(decoder.config, upsample_rates=[2, 2])
    fast = Qwen3TTSSpeechTokenizerDecoder(config)
    shapes = {k: v.shape for k, v in tree_flatten(fast.parameters())}
    weights = [(k, v) for k, v in tree_flatten(decoder.parameters()) if shapes.get(k) == v.shape]
    assert len(weights) == len(shapes) - 2
    fast.load_weights(weights, strict=False)
    mx.eval(fast.parameters())
    return fast


def _codes(frames: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 2048, (1, 16, frames)))


def _steps(first: int, frames: int) -> list[int]:
    """Step sizes as synthesis makes them: a first chunk of `first`, then chunks of 4 (here the
    second step tops the first up to 4, so that the stream passes every multiple of 4)."""
    return [first, 4 - first] + [4] * ((frames - 4) // 4)


def _stream(decoder, codes: mx.array, steps: list[int]) -> tuple[np.ndarray, dict]:
    """Decode `codes` step by step in a new stream; audio and kv_bytes() by frames decoded."""
    stream = new_stream(decoder)
    out, kv, at = [], {}, 0
    for n in steps:
        out.append(decode_step(decoder, stream, codes[:, :, at : at + n]))
        at += n
        kv[stream.frames] = stream.kv_bytes()
    mx.eval(out)
    return np.concatenate([np.array(a) for a in out]), kv


def test_window_mask_is_hugging_faces_sliding_window_causal_mask():
    # Query i sees key j iff i - 3 < j <= i (transformers' masking_utils example, window 3).
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                         [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], bool)  # fmt: skip
    np.testing.assert_array_equal(np.array(window_mask(0, 5, 3)), expected)
    # Two new frames after two cached ones: the last rows, over the last four keys.
    np.testing.assert_array_equal(np.array(window_mask(2, 2, 3)), expected[3:, 1:])


@pytest.mark.parametrize("first", [1, 2])
def test_long_stream_equals_windowed_decode_and_its_kv_stops_growing(fast, first):
    frames, per_frame = 300, fast.total_upsample
    codes = _codes(frames, seed=first)
    streamed, kv = _stream(fast, codes, _steps(first, frames))
    reference = np.array(windowed_decode(fast, codes))
    assert streamed.shape == reference.shape == (frames * per_frame,)
    assert np.abs(reference).max() > 1e-3  # the comparison is not between two silences
    np.testing.assert_allclose(streamed, reference, atol=ATOL, rtol=0)

    # mlx-audio's one-shot decode attends to every earlier frame: the same up to the window,
    # clearly different after it (frame 72 differs only by the one key it drops).
    full = np.array(fast(codes)[0, 0])
    per_frame_diff = np.abs(full - reference).reshape(frames, per_frame).max(axis=1)
    assert per_frame_diff[:72].max() < ATOL
    assert per_frame_diff[100:].min() > 2 * ATOL and per_frame_diff[100:].max() > 10 * ATOL

    # The cache holds the last 71 frames (what the next frame's query needs) and then stops.
    assert kv[8] < kv[72] == kv[100] == kv[300]
    assert kv[72] == 71 * kv[8] // 8


def test_streams_on_one_decoder_do_not_mix(decoder):
    """Two streams interleaved on the loaded vocoder each get what they get alone."""
    a, b = _codes(5, seed=10), _codes(5, seed=11)
    alone_a, _ = _stream(decoder, a, [1, 4])
    alone_b, _ = _stream(decoder, b, [1, 4])
    sa, sb = new_stream(decoder), new_stream(decoder)
    out = [decode_step(decoder, sa, a[:, :, :1]), decode_step(decoder, sb, b[:, :, :1]),
           decode_step(decoder, sa, a[:, :, 1:]), decode_step(decoder, sb, b[:, :, 1:])]  # fmt: skip
    mx.eval(out)
    np.testing.assert_array_equal(np.concatenate([np.array(out[0]), np.array(out[2])]), alone_a)
    np.testing.assert_array_equal(np.concatenate([np.array(out[1]), np.array(out[3])]), alone_b)
    # Within the window the windowed one-shot is mlx-audio's own (compiled) one-shot decode.
    np.testing.assert_allclose(np.array(decoder(a)[0, 0]), alone_a, atol=ATOL, rtol=0)


def test_batched_steps_equal_the_loop(fast, monkeypatch):
    """Streams of different ages share a batched call once their caches are full."""
    codes = [_codes(120, seed=20 + i) for i in range(3)]
    starts = [100, 80, 0]  # frames each stream has decoded before the shared steps
    steps = [4, 4, 2, 4]

    def run(batched: bool) -> list[np.ndarray]:
        streams = [new_stream(fast) for _ in codes]
        for s, c, start in zip(streams, codes, starts, strict=True):
            mx.eval([decode_step(fast, s, c[:, :, i : i + 4]) for i in range(0, start, 4)])
        out: list[list[mx.array]] = [[] for _ in codes]
        for n in steps:
            at = [s.frames for s in streams]
            items = [(s, c[:, :, i : i + n]) for s, c, i in zip(streams, codes, at, strict=True)]
            wavs = decode_steps(fast, items, batched=batched)
            for o, w in zip(out, wavs, strict=True):
                o.append(w)
        mx.eval(out)
        return [np.concatenate([np.array(w) for w in o]) for o in out]

    batch_sizes: list[int] = []
    step = vocoder._step

    def spy(decoder, streams, codes):
        batch_sizes.append(len(streams))
        return step(decoder, streams, codes)

    loop = run(batched=False)
    monkeypatch.setattr(vocoder, "_step", spy)
    batched = run(batched=True)
    # Both full caches share one call per step; the young stream runs alone until its cache fills.
    assert batch_sizes[-len(steps) * 2 :] == [2, 1] * len(steps)
    for got, want in zip(batched, loop, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_streams_leave_the_decoders_own_streaming_state_alone(fast):
    """mlx-audio's single-stream `streaming_step` still works between our streams' steps."""
    codes = _codes(8, seed=30)
    fast.reset_streaming_state()
    first = fast.streaming_step(codes[:, :, :4])
    _stream(fast, _codes(12, seed=31), [4, 4, 4])
    second = fast.streaming_step(codes[:, :, 4:])
    ours = np.concatenate([np.array(first[0, 0]), np.array(second[0, 0])])
    np.testing.assert_allclose(ours, np.array(fast(codes)[0, 0]), atol=ATOL, rtol=0)
    fast.reset_streaming_state()
