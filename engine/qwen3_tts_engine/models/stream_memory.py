"""The memory a worker's streams hold: what one stream of a request takes, and a batch of them.

Admission counts it against the worker's memory budget (`dispatch/capacity.py`, `Admission`);
the memory plan sizes a pod by it (`memory_plan.py`). Pure: config dicts in, bytes out. A stream
holds, as the worker runs it (`worker/scheduler.py`, `worker/vocoder.py`):
- the talker's KV cache: layers x K,V x kv heads x head_dim x the talker's dtype bytes per
  position, one position per frame after its prompt. mlx-lm's `BatchKVCache` grows 256 positions
  at a time and left-pads every row to the longest one, so a batch holds rows x the longest row
  (`batch_bytes`). A dual-track reply keeps one cache for the whole reply; the prompt layout
  starts a new row per sentence (its cap is the sentence's);
- the code predictor's cache: rebuilt every frame, but a plain `KVCache` allocates 256 positions
  at its first write, so 256 positions of its layers for the length of each step;
- the vocoder's decoder-transformer window (`sliding_window` - 1 frames, kept per stream);
- the vocoder's transient memory while it decodes the stream's 4-frame chunk (measured:
  `memory_plan.VOCODER_CHUNK_BYTES`; the convolutions at 24 kHz, not a config product).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from qwen3_tts_engine.protocol import Limits, SpeechRequest, default_max_new_tokens
from qwen3_tts_engine.sentences import split_input

KV_STEP = 256  # mlx-lm's KVCache / BatchKVCache grow their buffers this many positions at a time
# A stream's prompt before its first frame: the chat template, the speaker and language codes,
# and in the prompt layout its sentence's text (~30-37 positions for 7-9 words, NOTES.md). A
# voice-cloning prompt with reference audio holds more (its codes): rounding up to KV_STEP covers
# ~200 positions of them.
PROMPT_POSITIONS = 64


def kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """One position of a transformer's KV cache over all its layers: K and V."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def _head_dim(config: Mapping) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def kv_positions(frames: int) -> int:
    """Positions a talker cache row holds for a stream of `frames` frames: its prompt and frames,
    rounded up to the cache's growth step."""
    return math.ceil((frames + PROMPT_POSITIONS) / KV_STEP) * KV_STEP


@dataclass(frozen=True)
class StreamLayout:
    """Bytes a stream holds, by part (see the module docstring)."""

    talker_kv_per_frame: int
    predictor_kv: int  # per stream, while a step runs
    vocoder_kv: int  # per stream, its attention window
    chunk_transient: int = 0  # per stream, while its 4-frame chunk decodes

    @classmethod
    def from_config(cls, talker_config: Mapping, talker_dtype_bytes: int,
                    decoder_config: Mapping | None = None, vocoder_dtype_bytes: int = 4,
                    chunk_transient: int = 0) -> StreamLayout:  # fmt: skip
        """From a checkpoint's `talker_config` (config.json; its `code_predictor_config` inside)
        computing in `talker_dtype_bytes`, and the speech tokenizer's `decoder_config` (None:
        no vocoder) in `vocoder_dtype_bytes`."""
        t, cp = talker_config, talker_config["code_predictor_config"]
        talker = kv_bytes_per_position(t["num_hidden_layers"], t["num_key_value_heads"],
                                       _head_dim(t), talker_dtype_bytes)  # fmt: skip
        predictor = KV_STEP * kv_bytes_per_position(
            cp["num_hidden_layers"], cp["num_key_value_heads"], _head_dim(cp), talker_dtype_bytes
        )
        vocoder = 0
        if decoder_config is not None:
            d = decoder_config
            vocoder = (d["sliding_window"] - 1) * kv_bytes_per_position(
                d["num_hidden_layers"], d["num_key_value_heads"], _head_dim(d), vocoder_dtype_bytes
            )
        return cls(talker, predictor, vocoder, chunk_transient)

    @classmethod
    def from_dict(cls, d: Mapping) -> StreamLayout:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def per_stream(self) -> int:
        """A stream's bytes besides its talker KV cache."""
        return self.predictor_kv + self.vocoder_kv + self.chunk_transient

    def stream_bytes(self, frames: int) -> int:
        """One stream with a budget of `frames` frames, alone in its batch."""
        return self.batch_bytes([frames])

    def batch_bytes(self, frame_budgets: Sequence[int] | Iterable[int]) -> int:
        """A batch of streams with these frame budgets, each at its largest: every row padded to
        the longest one (`BatchKVCache`), plus each stream's own parts."""
        budgets = list(frame_budgets)
        if not budgets:
            return 0
        row = kv_positions(max(budgets)) * self.talker_kv_per_frame
        return len(budgets) * (row + self.per_stream())


def frame_budget(req: SpeechRequest, mode: str) -> int:
    """The most frames one cache row of `req` holds, as the worker caps it (`Scheduler._cap`):
    its `max_new_tokens`; else streamed text, whose length is not known while it is open, the
    global cap (`Limits.max_new_tokens`); else the default cap of its text
    (`protocol.default_max_new_tokens`): of the whole text dual-track (one cache), of its
    longest sentence in the prompt layout (a row per sentence). `mode`: `rules.text_mode_for`."""
    if req.max_new_tokens:
        return req.max_new_tokens
    if req.text_stream:
        return Limits.max_new_tokens
    texts = [req.input] if mode == "dual" else split_input(req.input)
    return max(default_max_new_tokens(t, req.instructions) for t in texts)
