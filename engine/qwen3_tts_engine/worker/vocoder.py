"""Streaming vocoder state kept per stream, with the decoder's trained sliding attention window.

mlx-audio keeps one stream's vocoder state on the decoder's modules and lets the pre-transformer's
KV cache grow for the whole utterance. Here each stream owns its state (swapped into the modules
for the length of one step, so one decoder serves many streams), and the pre-transformer attends
to the last `sliding_window` frames only, as the reference PyTorch decoder does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

# Where mlx-audio's `step` methods keep their history: `_buffer` on the causal convs (pre-conv,
# ConvNeXt, residual units, first and last conv), `_overflow` on the transposed-conv upsamplers.
_STATE_ATTRS = ("_buffer", "_overflow")


@dataclass(eq=False)
class VocoderStream:
    """One stream's vocoder state; advance it only through `decode_step` / `decode_steps`."""

    window: int  # attention window in frames (the decoder config's `sliding_window`)
    frames: int = 0  # frames decoded so far
    convs: list[mx.array | None] = field(default_factory=list)  # per stateful module; [] before
    keys: list[mx.array] = field(default_factory=list)  # per layer [1, heads, <= window-1, dim]
    values: list[mx.array] = field(default_factory=list)

    def kv_bytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def state_bytes(self) -> int:
        return self.kv_bytes() + sum(a.nbytes for a in self.convs if a is not None)


def new_stream(decoder) -> VocoderStream:
    return VocoderStream(window=decoder.config.sliding_window)


def window_mask(past: int, n: int, window: int) -> mx.array:
    """[n, past + n] bool over keys = `past` cached frames then the `n` new ones.

    As Hugging Face's sliding-window causal mask (`sliding_window_overlay` and causal):
    the query at position i sees the key at position j iff i - window < j <= i, i.e. itself and
    the window - 1 frames before it.
    """
    q = mx.arange(n)[:, None] + past
    k = mx.arange(past + n)[None]
    return (k <= q) & (k > q - window)


def decode_step(decoder, stream: VocoderStream, codes: mx.array) -> mx.array:
    """Decode the stream's next frames, codes [1, 16, n], into float32 audio [n * 1920] (lazy)."""
    return _step(decoder, [stream], codes)[0]


def decode_steps(
    decoder, items: list[tuple[VocoderStream, mx.array]], *, batched: bool = False
) -> list[mx.array]:
    """One step of several streams (each at most once), audio in the order given.

    With `batched`, streams with the same step length and cache length (all whose window is
    full) run as one call along the batch axis. Off by default: on mlx-cpu the vocoder's
    convolutions cost the same per stream either way, so batching gained nothing there.
    """
    if not batched:
        return [decode_step(decoder, stream, codes) for stream, codes in items]
    out: list[mx.array] = [mx.array(0)] * len(items)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (stream, codes) in enumerate(items):
        groups.setdefault((codes.shape[-1], _cached(stream)), []).append(i)
    for group in groups.values():
        codes = mx.concatenate([items[i][1] for i in group], axis=0)
        for i, wav in zip(group, _step(decoder, [items[i][0] for i in group], codes), strict=True):
            out[i] = wav
    return out


def windowed_decode(decoder, codes: mx.array) -> mx.array:
    """One-shot decode of codes [1, 16, frames] with the sliding-window mask: what a stream must
    equal. From an empty state one step is mlx-audio's one-shot `__call__` but for the mask."""
    return decode_step(decoder, new_stream(decoder), codes)


class _WindowCache:
    """What `DecoderAttention` calls `update_and_fetch` on: the cached frames plus the new ones."""

    def __init__(self, keys: mx.array | None, values: mx.array | None):
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        return keys, values


def _rows(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)


def _cached(stream: VocoderStream) -> int:
    return stream.keys[0].shape[2] if stream.keys else 0


def _module(decoder) -> nn.Module:
    """The decoder module itself: mlx-audio's loader wraps it in `mx.compile`, whose proxy
    passes methods through but hides child modules (and passes `isinstance` checks too)."""
    return decoder.streaming_step.__self__


def _stateful(decoder: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, a) for _, m in decoder.named_modules() for a in _STATE_ATTRS if hasattr(m, a)]


def _pre_transformer(transformer, x: mx.array, positions: mx.array, mask: mx.array, caches):
    """`DecoderTransformer.__call__` with explicit per-row positions and mask."""
    x = transformer.input_proj(x)
    embeddings = transformer.rotary_emb(x, positions)
    for layer, cache in zip(transformer.layers, caches, strict=True):
        x = layer(x, embeddings, mask, cache)
    return transformer.output_proj(transformer.norm(x))


def _step(decoder, streams: list[VocoderStream], codes: mx.array) -> list[mx.array]:
    """One step of streams with the same cache length, their codes stacked on the batch axis.

    Mirrors `Qwen3TTSSpeechTokenizerDecoder.streaming_step` but for the pre-transformer.
    """
    decoder = _module(decoder)
    n = codes.shape[-1]
    first = streams[0]
    past = _cached(first)
    slots = _stateful(decoder)
    saved = [getattr(m, a) for m, a in slots]
    try:
        for i, (m, a) in enumerate(slots):
            rows = [s.convs[i] for s in streams] if first.convs else [None]
            setattr(m, a, None if rows[0] is None else _rows(rows))
        caches = [
            _WindowCache(_rows([s.keys[layer] for s in streams]),
                         _rows([s.values[layer] for s in streams])) if past
            else _WindowCache(None, None)
            for layer in range(len(decoder.pre_transformer.layers))
        ]  # fmt: skip
        positions = mx.array([s.frames for s in streams])[:, None] + mx.arange(n)[None]

        hidden = decoder.quantizer.decode(codes).transpose(0, 2, 1)  # [B, n, codebook_dim]
        hidden = decoder.pre_conv.step(hidden)
        hidden = _pre_transformer(decoder.pre_transformer, hidden, positions,
                                  window_mask(past, n, first.window), caches)  # fmt: skip
        for upsample, convnext in decoder.upsample:
            hidden = convnext.step(upsample(hidden))
        wav = decoder.decoder[0].step(hidden)
        for block in decoder.decoder[1:-2]:
            wav = block.step(wav)
        wav = mx.clip(decoder.decoder[-1].step(decoder.decoder[-2](wav)), -1.0, 1.0)

        # The next step's first query needs the window - 1 frames before it.
        start = max(past + n - (first.window - 1), 0)
        for b, s in enumerate(streams):
            # Copies, not views: a slice would pin the whole step's activation buffer.
            s.convs = [None if (v := getattr(m, a)) is None else mx.contiguous(v[b : b + 1])
                       for m, a in slots]  # fmt: skip
            s.keys = [mx.contiguous(c.keys[b : b + 1, :, start:]) for c in caches]
            s.values = [mx.contiguous(c.values[b : b + 1, :, start:]) for c in caches]
            s.frames += n
    finally:
        for (m, a), v in zip(slots, saved, strict=True):
            setattr(m, a, v)
    return [wav[b, :, 0].astype(mx.float32) for b in range(len(streams))]
