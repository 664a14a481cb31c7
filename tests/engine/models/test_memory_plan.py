"""The footprint model on the real Qwen3-TTS 0.6B architecture (models/memory_plan.py).

Weights are computed from mlx-audio's own parameter shapes (lazy arrays: nothing is allocated)
and the recipes, and must match what the real-size bench loaded; process memory adds the
overheads measured by that bench. The bottom rung's share of bf16's memory, the figure users
plan memory by, is held here: after load and between utterances at most 0.40, while speaking at
most PEAK_RATIO, while loading at most LOAD_RATIO; computing in float32 (the CPU default), at
most CPU_DEFAULT_RATIO.
"""

from __future__ import annotations

import math

import pytest

from qwen3_tts_engine.governor.policy import Policy
from qwen3_tts_engine.models import memory_plan as plan
from qwen3_tts_engine.models.footprint import estimate_weight_bytes, vocoder_bytes
from qwen3_tts_engine.models.recipes import get_recipe

MB = 10**6
STEADY_RATIO = 0.40  # bottom rung / bf16: after load, and between utterances
PEAK_RATIO = 0.45  # bottom rung / bf16: the largest RSS while each speaks one stream
LOAD_RATIO = 0.55  # bottom rung / bf16: the largest RSS while each loads
CPU_DEFAULT_RATIO = 0.35  # the same after load and while speaking, computing in float32


@pytest.fixture(scope="module")
def real():
    from qwen3_tts_engine.bench.memory import real_size_tensors

    return real_size_tensors()


def memory(real, variant: str, compute_dtype: str | None = None) -> plan.RungMemory:
    """One worker of `variant` on the real 0.6B architecture, by the model."""
    return plan.rung_memory(variant, plan.weight_bytes(*real[:2], variant, real[2], compute_dtype))


def test_the_real_size_table_costs_no_weights():
    """Building mlx-audio's modules at the real sizes evaluates no weight (the table is free)."""
    import mlx.core as mx

    from qwen3_tts_engine.bench.memory import real_size_tensors

    before = mx.get_active_memory()
    root, vocoder, layers = real_size_tensors()
    assert mx.get_active_memory() - before < 20 * MB  # evaluated: 1.8 GB talker + 0.46 GB vocoder
    assert layers == 28 and len(root) > 300 and all(n.startswith("decoder.") for n in vocoder)
    assert sum(bf16_bytes(root).values()) == pytest.approx(1811.6 * MB, abs=0.1 * MB)


def bf16_bytes(tensors) -> dict[str, int]:
    return {name: math.prod(shape) * 2 for name, (shape, _) in tensors.items()}


ROWS = [(v, None) for v in sorted(plan.MEASURED)] + [
    (v, "float32") for v in sorted(plan.MEASURED_FLOAT32)
]


def measured(variant: str, compute_dtype: str | None) -> plan.Measurement:
    return (plan.MEASURED_FLOAT32 if compute_dtype else plan.MEASURED)[variant]


@pytest.mark.parametrize(("variant", "compute_dtype"), ROWS)
def test_weights_match_what_the_real_size_bench_loaded(real, variant, compute_dtype):
    root, vocoder, layers = real
    m, recipe = measured(variant, compute_dtype), get_recipe(variant)
    # the bench reports 0.1 MB
    assert estimate_weight_bytes(root, recipe, layers, compute_dtype) == pytest.approx(
        m.talker, abs=0.06 * MB
    )
    assert vocoder_bytes(vocoder, recipe) == pytest.approx(m.vocoder, abs=0.06 * MB)


@pytest.mark.parametrize(("variant", "compute_dtype"), ROWS)
def test_the_model_covers_each_measured_rung_closely(real, variant, compute_dtype):
    """Weights + the largest overheads measured: never below a measurement (each rounded to 0.1
    MB); at most 2 % above one made with the weights' dtype, 10 % above a float32 one (a float32
    talker's load peaks lower)."""
    m, est = measured(variant, compute_dtype), memory(real, variant, compute_dtype)
    for key in ("after_load", "after", "loading", "speaking"):
        got, want = getattr(est, key), getattr(m, key)
        assert want - 0.15 * MB <= got <= want * (1.1 if compute_dtype else 1.02), (
            variant,
            key,
            got / MB,
            want / MB,
        )


def test_the_bottom_rung_takes_at_most_40_percent_of_bf16_between_utterances(real):
    """What a user can plan memory by, on the default ladder's bottom rung against bf16, from
    the model and from the measurements: after load and between utterances <= 0.40; while
    speaking one stream <= PEAK_RATIO (~0.44: the vocoder's transient memory, ~200-240 MB on
    every rung, does not shrink with the weights, and its bfloat16 copy keeps the most); while
    loading <= LOAD_RATIO (~0.53: the bottom rung loads its vocoder in float32 and casts it)."""
    bottom = Policy().ladder[-1]
    low, high = memory(real, bottom), memory(real, "bf16")
    keys = ("weights", "after_load", "after", "loading", "speaking")
    ratio = {k: getattr(low, k) / getattr(high, k) for k in keys}
    assert ratio["weights"] <= 0.33, ratio
    assert ratio["after_load"] <= STEADY_RATIO and ratio["after"] <= STEADY_RATIO, ratio
    assert ratio["speaking"] <= PEAK_RATIO and ratio["loading"] <= LOAD_RATIO, ratio
    # the same from the bench's own numbers, where both rungs were measured
    if bottom in plan.MEASURED:
        ml, mh = plan.MEASURED[bottom], plan.MEASURED["bf16"]
        measured = {k: getattr(ml, k) / getattr(mh, k) for k in keys[1:]}
        assert measured["after_load"] <= STEADY_RATIO and measured["after"] <= STEADY_RATIO, (
            measured
        )
        assert measured["speaking"] <= PEAK_RATIO and measured["loading"] <= LOAD_RATIO, measured


def test_computing_in_float32_the_bottom_rung_takes_at_most_35_percent_of_bf16(real):
    """`--compute-dtype auto`, float32 on a CPU: bf16's talker doubles, so the bottom rung's
    share falls (0.27 after load, ~0.31 while speaking)."""
    bottom = Policy().ladder[-1]
    low, high = memory(real, bottom, "float32"), memory(real, "bf16", "float32")
    for key in ("after_load", "after", "speaking"):
        assert getattr(low, key) / getattr(high, key) <= CPU_DEFAULT_RATIO, key
    ml, mh = plan.MEASURED_FLOAT32[bottom], plan.MEASURED_FLOAT32["bf16"]
    assert (
        max(ml.after_load / mh.after_load, ml.after / mh.after, ml.speaking / mh.speaking)
        <= CPU_DEFAULT_RATIO
    )


def test_float32_compute_widens_the_talker_but_not_its_embeddings(real):
    """`--compute-dtype auto` on a CPU (float32): bf16's talker grows by its non-embedding
    weights (~1.1 GB), a 4-bit one by its scales, biases and norms only."""
    root, _, layers = real
    emb = sum(n for name, n in bf16_bytes(root).items() if "embedding" in name)
    for variant, grows in (("bf16", (1811.6 * MB - emb)), ("4bit-emb4-voc16", None)):
        weights, wide = memory(real, variant).weights, memory(real, variant, "float32").weights
        if grows is not None:
            assert wide - weights == pytest.approx(grows, rel=0.001)
        else:
            assert 0 < wide - weights < 0.1 * weights


def test_engine_arithmetic_counts_the_server_the_spare_and_both_workers():
    a = plan.RungMemory("bf16", 10, 20, 21, loading=35, speaking=30)
    b = plan.RungMemory("8bit", 5, 12, 13, loading=16, speaking=17)
    with_spare = plan.EngineMemory([a, b], spare_worker=True, server=3, spare=4)
    assert with_spare.serving(0) == 3 + 4 + 30 and with_spare.settled(1) == 3 + 4 + 13
    assert with_spare.starting(0) == 3 + 4 + 35
    assert (
        with_spare.swap_bytes(0) == 3 + 4 + 30 + 17
    )  # the old one speaking, the new at its largest
    assert with_spare.limit_for_swaps(0.5) == 2 * (3 + 4 + 30 + 17)
    without = plan.EngineMemory([a, b], spare_worker=False, server=3, spare=4)
    assert without.swap_bytes(0) == 3 + 30 + 17 and without.request() == 33
    assert (
        plan.EngineMemory([a, plan.RungMemory("4bit", 1, 2, 3, 19, 9)], False, 0, 0).swap_bytes(0)
        == 30 + 19
    )
    assert plan.EngineMemory([a], spare_worker=False).limit_for_swaps(0.95) == 0


def test_the_bench_reads_a_peak_and_resets_it():
    """The bench's peaks (MEASURED's loading and speaking) are the kernel's RSS high-water mark,
    reset between load and speech: both work on a process of ours (Linux; None elsewhere)."""
    import os
    from pathlib import Path

    from qwen3_tts_engine.bench.memory import _hwm, _reset_hwm

    pid = os.getpid()
    if not Path(f"/proc/{pid}/status").is_file():
        assert _hwm(pid) is None
        return
    block = b"\x01" * (200 * MB)  # written, so resident
    high = _hwm(pid)
    del block
    assert high >= 200 * MB
    assert _reset_hwm(pid)
    assert _hwm(pid) < high - 150 * MB  # back to the RSS now, the 200 MB returned


def test_the_plans_attention_shapes_are_the_real_architectures():
    """`REAL_TALKER_CONFIG` / `REAL_DECODER_CONFIG` (what a stream's caches take) are mlx-audio's
    real 0.6B configs, so the plan's stream bytes are those of the real model."""
    import dataclasses

    from mlx_audio.tts.models.qwen3_tts.config import Qwen3TTSTokenizerDecoderConfig

    from qwen3_tts_engine.bench.memory import real_size_config

    talker = real_size_config()["talker_config"]
    for key, value in plan.REAL_TALKER_CONFIG.items():
        if key == "code_predictor_config":
            for k, v in value.items():
                assert talker[key][k] == v, k
        else:
            assert talker[key] == value, key
    decoder = dataclasses.asdict(Qwen3TTSTokenizerDecoderConfig())
    assert {k: decoder[k] for k in plan.REAL_DECODER_CONFIG} == plan.REAL_DECODER_CONFIG


def test_the_limit_for_a_batch_of_streams_is_the_settled_engine_plus_streams_and_headroom():
    """limit = (server + spare + the worker settled + the streams + headroom) / downgrade_at,
    and a bf16 stream at the 4096-frame cap holds its ~0.5 GB cache row plus its own parts."""
    from qwen3_tts_engine.protocol import Limits

    a = plan.RungMemory("bf16", 10, 20, 21, loading=35, speaking=30)
    em = plan.EngineMemory([a], spare_worker=True, server=3, spare=4)
    assert em.with_streams(0, 100) == 3 + 4 + 21 + 100
    assert em.limit_for_streams(0, 100, 0.5, headroom=2) == 2 * (3 + 4 + 21 + 100 + 2)
    layout = plan.real_stream_layout("bf16")
    assert layout.chunk_transient == plan.VOCODER_CHUNK_BYTES > 0
    # the bench read the talker cache's bytes per position from its arrays: the arithmetic's
    assert plan.BATCH.kv_per_position == layout.talker_kv_per_frame
    one = layout.stream_bytes(Limits.max_new_tokens)
    assert one == 4352 * 114_688 + layout.per_stream()
    assert plan.real_stream_layout("bf16", "float32").talker_kv_per_frame == 2 * 114_688
    sixteen = plan.real_stream_layout("4bit-emb4-voc16")
    assert (
        sixteen.vocoder_kv * 2 == layout.vocoder_kv
        and sixteen.chunk_transient > layout.chunk_transient
    )
