"""Process memory of an engine serving the real Qwen3-TTS 0.6B, per rung, and the memory request
and limit a deployment of it needs: a footprint model that a test evaluates without writing a
weight.

One engine worker of a rung takes
  weights    exact, from the architecture's parameter shapes and the rung's recipe: the talker as
             the recipe quantizes it, widened to the compute dtype
             (`footprint.estimate_weight_bytes`), plus the speech tokenizer's decoder (the
             vocoder) in the recipe's dtype (`footprint.vocoder_bytes`); a CustomVoice model
             drops the tokenizer's encoder at load (`worker.loading.load_checkpoint`);
  + runtime  measured: interpreter, libraries, text tokenizer, buffers, after load and after an
             utterance (between utterances);
  + loading  measured: the largest RSS while it loads, over the RSS after load: the encoder read
             and dropped, file buffers, and for a 16-bit vocoder its float32 copy before the cast;
  + speaking measured: the largest RSS while it speaks one stream, over the RSS after load. It
             depends on the vocoder's dtype: mlx-cpu's bfloat16 vocoder keeps more transient
             memory than a float32 one.
Its streams add what `stream_memory.py` counts (KV caches for their frame budgets, vocoder state,
and the vocoder's transients, measured with a full batch: `BATCH`); a deployment's limit holds
`--max-batch` streams at the frame cap (`EngineMemory.limit_for_streams`).
An engine adds its server process (no mlx) and, with `--spare-worker`, a started worker with no
model. The governor (governor/policy.py) swaps make-before-break when the working set (server,
the old worker while it speaks, the spare) plus the new rung's footprint stays under
`make_before_break_below` x the limit (`EngineMemory.swap_bytes`).

Pure (no mlx): the parameter table comes from the caller; `bench.memory.real_size_tensors()`
reads it from mlx-audio's model classes without materialising a weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qwen3_tts_engine.models.footprint import Tensors, estimate_weight_bytes, vocoder_bytes
from qwen3_tts_engine.models.recipes import RECIPES, Recipe, get_recipe
from qwen3_tts_engine.models.stream_memory import StreamLayout

MB = 10**6


@dataclass(frozen=True)
class Measurement:
    """One rung on the real-size architecture (`bench/memory.py`, one fresh worker), bytes."""

    talker: int  # talker weights as loaded (`worker.measure.model_bytes`)
    vocoder: int  # speech tokenizer as loaded (its decoder; CustomVoice drops the encoder)
    after_load: int  # RSS after load (freed memory given back)
    loading: int  # the largest RSS while loading (VmHWM after load)
    speaking: int  # the largest RSS while it speaks one stream of 2 frames (see MEASURED)
    after: int  # RSS after the utterance


# `python -m qwen3_tts_engine.bench.memory --variants bf16,8bit,4bit,4bit-emb4-voc16` at commit
# 3f6402a (2026-12-03; Linux x86-64, mlx-cpu, 2 cores; the CustomVoice 0.6B architecture with
# random weights; the talker computing in its weights' dtype), MB. Loading: the worker's VmHWM
# after load. Speaking: the largest of that run's RSS sampled every 50 ms and a second run's
# (`--variants bf16,4bit-emb4-voc16`) VmHWM after the utterance, reset after load: bf16 2682.8
# sampled (2670.3 exact in the second run), the bottom rung 1178.2 exact (1146.2 sampled: the
# sampler misses the vocoder's shortest peaks).
MEASURED_AT = "commit 3f6402a, 2026-12-03, Linux x86-64, mlx-cpu"
MEASURED: dict[str, Measurement] = {
    # rung: talker, vocoder, after load, loading, speaking, after the utterance
    "bf16": Measurement(*(round(x * MB) for x in (1811.6, 457.2, 2467.7, 2784.9, 2682.8, 2487.5))),
    "8bit": Measurement(*(round(x * MB) for x in (1286.6, 457.2, 1942.7, 2261.0, 2143.3, 1962.6))),
    "4bit": Measurement(*(round(x * MB) for x in (1006.7, 457.2, 1662.6, 1980.9, 1863.3, 1682.6))),
    "4bit-emb4-voc16": Measurement(*(round(x * MB) for x in (509.6, 228.6, 936.9, 1481.8, 1178.2, 957.3))),
}  # fmt: skip
# The same with `--compute-dtype float32` (what `auto` is on a CPU), `--variants
# bf16,4bit-emb4-voc16` (speaking: bf16 exact, as its peak exceeded the load's; the bottom rung
# sampled): the talker's weights widen; the overheads stay within 0.2 MB of the ones above.
MEASURED_FLOAT32: dict[str, Measurement] = {
    "bf16": Measurement(*(round(x * MB) for x in (2931.6, 457.2, 3587.2, 3646.3, 3752.6, 3606.6))),
    "4bit-emb4-voc16": Measurement(*(round(x * MB) for x in (544.8, 228.6, 972.5, 1481.8, 1152.4, 992.6))),
}  # fmt: skip

# The other processes of an engine, measured (`qwen3-tts serve --spare-worker` on the tiny
# checkpoint, same commit; RSS by process with psutil): the server process 64.0 MB plus
# multiprocessing's resource tracker 12.8 MB; the spare worker (modules imported, no model)
# 88.4 MB. Rounded up.
SERVER_BYTES = 77 * MB
SPARE_WORKER_BYTES = 89 * MB


@dataclass(frozen=True)
class BatchMeasurement:
    """A full batch on the real-size architecture (`qwen3-tts bench memory`), bytes."""

    streams: int  # speaking together, 4-frame chunks
    frames: int  # per stream
    rss_after_load: int
    rss_peak: int  # the kernel's RSS high-water mark while the batch spoke (reset after load)
    mlx_peak: int  # mlx's peak active memory (weights included)
    kv_per_position: int  # the talker cache's bytes per position and row, read from its arrays

    @property
    def speaking(self) -> int:
        return self.rss_peak - self.rss_after_load


# `qwen3-tts bench memory --max-batch 8 --frames 8 --compute-dtype weights` on the working tree
# on f25a216 (2026-12-05; Linux x86-64, mlx-cpu, 2 cores, shared; the CustomVoice 0.6B
# architecture with random weights, bf16 rung, the talker computing in bfloat16): 8 streams x 8
# frames, two 4-frame chunks each, 237 s. MB: weights 2268.7 (talker 1811.6 + speech tokenizer
# 457.2); RSS after load 2482.4, peak 3242.8 (1.43 x the weights); mlx after load 2268.7, peak
# 2912.9. The talker cache: 256 positions x 8 rows x 114688 bytes (235 MB) from the first step,
# the same at every step (one growth step holds the prompt and 8 frames).
BATCH_MEASURED_AT = "working tree on f25a216, 2026-12-05, Linux x86-64, mlx-cpu"
BATCH = BatchMeasurement(streams=8, frames=8, rss_after_load=round(2482.4 * MB),
                         rss_peak=round(3242.8 * MB), mlx_peak=round(2912.9 * MB),
                         kv_per_position=114_688)  # fmt: skip
# The real 0.6B's attention shapes (mlx-audio's configs; tests/engine/models/test_memory_plan.py
# holds them to `bench.memory.real_size_config()`): what a stream's caches take.
REAL_TALKER_CONFIG = {
    "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
    "code_predictor_config": {"num_hidden_layers": 5, "num_key_value_heads": 8, "head_dim": 128},
}  # fmt: skip
REAL_DECODER_CONFIG = {"num_hidden_layers": 8, "num_key_value_heads": 16, "head_dim": 64,
                       "sliding_window": 72}  # fmt: skip


def _batch_transient(batch: BatchMeasurement) -> int:
    """Per stream, what the batch's peak held besides the streams' caches: the vocoder's
    transients while the batch's chunks decode, activations, allocator slack."""
    layout = StreamLayout.from_config(REAL_TALKER_CONFIG, 2, REAL_DECODER_CONFIG, 4)
    return max(
        0, (batch.speaking - layout.batch_bytes([batch.frames] * batch.streams)) // batch.streams
    )


# The vocoder's transient memory per stream per 4-frame chunk (float32 vocoder), from BATCH; the
# speech tokenizer is the same in every Qwen3-TTS 12 Hz model, so a tiny test checkpoint is
# over-counted by it. `models/stream_memory.py` adds it to each stream.
VOCODER_CHUNK_BYTES = _batch_transient(BATCH)
# What the limit keeps below the governor's downgrade watermark beyond the counted streams: the
# KV cache's growth copy (a 256-position step reallocates a layer's cache), allocator slack.
HEADROOM_BYTES = 256 * MB


@dataclass(frozen=True)
class Overhead:
    """Process memory besides the weights, bytes: the largest seen over the measured rungs (the
    transients by the vocoder's dtype: float32, or 16 bits)."""

    after_load: int
    after: int  # after an utterance
    loading: tuple[int, int]  # the largest RSS while loading minus the RSS after load
    speaking: tuple[int, int]  # the largest RSS while speaking minus the RSS after load

    def while_loading(self, recipe: Recipe) -> int:
        return self.loading[bool(recipe.vocoder_dtype)]

    def while_speaking(self, recipe: Recipe) -> int:
        return self.speaking[bool(recipe.vocoder_dtype)]


def overhead_from(rows: Iterable[tuple[str, Measurement]]) -> Overhead:
    """The largest overheads over `rows` (variant, measurement)."""
    rows = list(rows)

    def most(values) -> int:
        values = list(values)
        if not values:
            raise ValueError("no measured rung for this overhead")
        return max(values)

    def by_vocoder(field: str) -> tuple[int, int]:
        return tuple(most(getattr(m, field) - m.after_load for v, m in rows
                          if bool(get_recipe(v).vocoder_dtype) is sixteen)
                     for sixteen in (False, True))  # fmt: skip

    return Overhead(
        after_load=most(m.after_load - m.talker - m.vocoder for _, m in rows),
        after=most(m.after - m.talker - m.vocoder for _, m in rows),
        loading=by_vocoder("loading"), speaking=by_vocoder("speaking"),
    )  # fmt: skip


OVERHEAD = overhead_from([*MEASURED.items(), *MEASURED_FLOAT32.items()])


def chunk_transient_bytes(variant: str | None) -> int:
    """`VOCODER_CHUNK_BYTES` for `variant`'s vocoder: a 16-bit vocoder's in the ratio of the
    one-stream speaking overheads measured per vocoder dtype (mlx-cpu keeps more for bfloat16)."""
    sixteen = variant is not None and variant in RECIPES and bool(get_recipe(variant).vocoder_dtype)
    if not sixteen:
        return VOCODER_CHUNK_BYTES
    return round(VOCODER_CHUNK_BYTES * OVERHEAD.speaking[1] / OVERHEAD.speaking[0])


def real_stream_layout(variant: str, compute_dtype: str | None = None) -> StreamLayout:
    """A stream of the real 0.6B on `variant`: its caches in the talker's compute dtype (None: the
    weights', bfloat16 on every rung) and the vocoder's, and the vocoder's chunk transient."""
    recipe = get_recipe(variant)
    talker = 4 if compute_dtype == "float32" else 2
    return StreamLayout.from_config(REAL_TALKER_CONFIG, talker, REAL_DECODER_CONFIG,
                                    2 if recipe.vocoder_dtype else 4,
                                    chunk_transient_bytes(variant))  # fmt: skip


@dataclass(frozen=True)
class RungMemory:
    """One worker of `variant`, bytes."""

    variant: str
    weights: int
    after_load: int
    after: int  # between utterances
    loading: int  # the largest RSS while it loads
    speaking: int  # the largest RSS while it speaks one stream

    @property
    def largest(self) -> int:
        return max(self.loading, self.speaking)

    @property
    def mb(self) -> dict[str, float]:
        keys = ("weights", "after_load", "after", "loading", "speaking")
        return {k: round(getattr(self, k) / MB, 1) for k in keys}


def weight_bytes(tensors: Tensors, vocoder_tensors: Tensors, variant: str, num_talker_layers: int,
                 compute_dtype: str | None = None) -> int:  # fmt: skip
    """Weights of one worker of `variant`: `tensors` (the model's own, full precision) as its
    recipe quantizes them, the talker computing in `compute_dtype` (None: the weights' dtype),
    plus `vocoder_tensors` (the speech tokenizer's, named `decoder.*`) in its vocoder dtype."""
    recipe = get_recipe(variant)
    return (estimate_weight_bytes(tensors, recipe, num_talker_layers, compute_dtype)
            + vocoder_bytes(vocoder_tensors, recipe))  # fmt: skip


def rung_memory(variant: str, weights: int, overhead: Overhead = OVERHEAD) -> RungMemory:
    recipe = get_recipe(variant)
    after_load = weights + overhead.after_load
    return RungMemory(variant, weights, after_load, weights + overhead.after,
                      after_load + overhead.while_loading(recipe),
                      after_load + overhead.while_speaking(recipe))  # fmt: skip


@dataclass(frozen=True)
class EngineMemory:
    """An engine on a ladder (largest first), with or without a spare worker, bytes."""

    rungs: Sequence[RungMemory]
    spare_worker: bool
    server: int = SERVER_BYTES
    spare: int = SPARE_WORKER_BYTES

    def others(self) -> int:
        return self.server + (self.spare if self.spare_worker else 0)

    def starting(self, i: int) -> int:
        """The working set while rung `i` loads at the engine's start."""
        return self.others() + self.rungs[i].loading

    def serving(self, i: int) -> int:
        """The working set while rung `i` speaks."""
        return self.others() + self.rungs[i].speaking

    def settled(self, i: int) -> int:
        """The working set with rung `i` loaded, between utterances."""
        return self.others() + max(self.rungs[i].after_load, self.rungs[i].after)

    def swap_bytes(self, i: int) -> int:
        """The swap from rung `i` to `i + 1` while rung `i` speaks: the working set plus the new
        worker at its largest (loading or speaking). With a spare worker the new one grows from
        the spare, whose memory is then counted twice, as the governor counts it
        (`policy.choose_mode`: the working set plus the new rung's footprint)."""
        return self.serving(i) + self.rungs[i + 1].largest

    def limit_for_swaps(self, make_before_break_below: float) -> int:
        """The smallest limit at which every one-rung swap down the ladder is make-before-break."""
        most = max((self.swap_bytes(i) for i in range(len(self.rungs) - 1)), default=0)
        return math.ceil(most / make_before_break_below)

    def request(self) -> int:
        """A memory request that covers the top rung while it speaks (the kubelet evicts pods
        above their request first when a node runs short of memory)."""
        return self.serving(0)

    def with_streams(self, i: int, stream_bytes: int) -> int:
        """The working set with rung `i` loaded (settled) and its streams holding
        `stream_bytes` (`StreamLayout.batch_bytes`)."""
        return self.settled(i) + stream_bytes

    def limit_for_streams(self, i: int, stream_bytes: int, downgrade_at: float,
                          headroom: int = HEADROOM_BYTES) -> int:  # fmt: skip
        """The smallest limit under whose downgrade watermark rung `i` holds `stream_bytes` of
        streams with `headroom` to spare: limit = (server + spare + the worker settled + the
        streams + headroom) / downgrade_at. Admission's budget ("auto", `config.worker_budget`)
        is then at least the streams' bytes, so they start without waiting or a swap."""
        return math.ceil((self.with_streams(i, stream_bytes) + headroom) / downgrade_at)
