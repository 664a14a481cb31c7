"""The governor's policy as pure functions on simulated time: ladder, hysteresis, cool-down, fit."""

from __future__ import annotations

import random

import pytest

from qwen3_tts_engine.governor.memory import MemoryReading
from qwen3_tts_engine.governor.policy import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    Policy,
    PolicyState,
    after_swap,
    choose_mode,
    decide,
    effective_ladder,
)

GB = 1 << 30
LIMIT = 10 * GB
FOOTPRINTS = {"bf16": 2 * GB, "8bit": int(1.1 * GB), "4bit": int(0.6 * GB)}


def reading(pressure: float, level: str | None = None) -> MemoryReading:
    return MemoryReading("manual", LIMIT, int(pressure * LIMIT), level, at=0.0)


def simulate(policy: Policy, pressure_at, start: str = "bf16", seconds: float = 60.0,
             dt: float = 0.25, footprints=FOOTPRINTS) -> list[tuple[float, str]]:  # fmt: skip
    """Run the policy on simulated time; a swap is applied at once. Returns (time, variant)."""
    state, current, swaps = PolicyState(), start, []
    for i in range(int(seconds / dt) + 1):
        now = i * dt
        decision, state = decide(policy, state, reading(pressure_at(now, current)), current,
                                 footprints, now)  # fmt: skip
        if decision is not None:
            current = decision.target
            swaps.append((now, current))
            state = after_swap(state, now)
    return swaps


def constant(p: float):
    return lambda t, variant: p


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {"ladder": ()}, {"ladder": ("bf16", "bf16")}, {"ladder": ("bf16", "2bit")},
    {"upgrade_at": 0.9, "downgrade_at": 0.85}, {"critical_at": 0.8}, {"cooldown_s": -1},
    {"mode": "sideways"},
])  # fmt: skip
def test_bad_policies_are_refused(kw):
    with pytest.raises(ValueError):
        Policy(**kw)


@pytest.mark.parametrize(("ladder", "start", "expected"), [
    (("bf16", "8bit", "4bit"), "bf16", ("bf16", "8bit", "4bit")),
    (("bf16", "8bit", "4bit"), "8bit", ("8bit", "4bit")),
    (("bf16", "8bit", "4bit"), "6bit", ("6bit", "4bit")),
    (("bf16", "8bit", "4bit"), "talker-mlp-w4", ("talker-mlp-w4", "8bit", "4bit")),
    (("bf16", "8bit", "4bit"), "keep-code-predictor", ("keep-code-predictor", "4bit")),
    (("bf16", "8bit", "6bit", "4bit"), "4bit", ("4bit",)),
])  # fmt: skip
def test_the_ladder_starts_at_the_start_variant(ladder, start, expected):
    assert effective_ladder(ladder, start) == expected


# -- single decisions -----------------------------------------------------------------------


def test_downgrade_waits_for_the_hold_time():
    policy = Policy(downgrade_hold_s=3.0)
    swaps = simulate(policy, constant(0.9), seconds=10)
    assert swaps[0] == (3.0, "8bit")


def test_a_dip_below_the_watermark_restarts_the_hold():
    policy = Policy(downgrade_hold_s=3.0)
    swaps = simulate(policy, lambda t, v: 0.8 if 2.0 <= t < 2.5 else 0.9, seconds=10)
    assert swaps[0] == (5.5, "8bit")


def test_critical_pressure_steps_down_at_once_even_in_cool_down():
    policy = Policy()
    state = after_swap(PolicyState(), now=100.0)
    decision, _ = decide(policy, state, reading(0.97), "8bit", FOOTPRINTS, now=100.5)
    assert decision is not None and decision.target == "4bit" and decision.cause == "critical"


def test_the_kernel_warning_level_counts_as_pressure():
    policy = Policy(downgrade_hold_s=0.0)
    decision, _ = decide(policy, PolicyState(), reading(0.3, "warn"), "bf16", FOOTPRINTS, 0.0)
    assert decision is not None and decision.target == "8bit"


def test_no_move_past_either_end_of_the_ladder():
    policy = Policy(downgrade_hold_s=0, upgrade_hold_s=0)
    assert (
        decide(policy, PolicyState(), reading(0.99), policy.ladder[-1], FOOTPRINTS, 0.0)[0] is None
    )
    assert decide(policy, PolicyState(), reading(0.01), "bf16", FOOTPRINTS, 0.0)[0] is None


def test_cool_down_delays_the_next_swap():
    policy = Policy(downgrade_hold_s=3.0, cooldown_s=20.0)
    swaps = simulate(policy, constant(0.9), seconds=60)
    assert swaps == [(3.0, "8bit"), (23.0, "4bit"), (43.0, "4bit-emb8")]


def test_the_default_ladder_ends_at_the_rung_that_shrinks_embeddings_and_vocoder():
    from qwen3_tts_engine.governor.policy import nominal_bits
    from qwen3_tts_engine.models.recipes import RECIPES

    ladder = Policy().ladder
    assert ladder[0] == "bf16" and ladder[-1] == "4bit-emb4-voc16"
    assert [nominal_bits(v) for v in ladder] == sorted(
        (nominal_bits(v) for v in ladder), reverse=True
    )
    assert RECIPES[ladder[-1]].vocoder_dtype == "bfloat16"


def test_upgrade_after_the_hold_when_the_larger_variant_fits():
    policy = Policy(upgrade_hold_s=30.0)
    swaps = simulate(policy, constant(0.5), start="4bit", seconds=61)
    # The second needs its own hold: readings from before a swap do not count after it.
    assert swaps == [(30.0, "8bit"), (60.25, "bf16")]


def test_upgrade_is_refused_when_the_larger_variant_would_not_fit():
    policy = Policy(upgrade_at=0.65, downgrade_at=0.85, upgrade_hold_s=0)
    # 0.6 used + (2.0 - 0.6) GB more of a 10 GB limit = 0.74: fits; at 0.64 used with a 3 GB bf16
    # footprint: 0.64 + 0.24 = 0.88 >= 0.85: it would be pushed straight back down.
    big = {**FOOTPRINTS, "8bit": int(0.6 * GB), "bf16": 3 * GB}
    decision, state = decide(policy, PolicyState(), reading(0.64), "8bit", big, 0.0)
    assert decision is None and "would not fit" in state.note
    decision, _ = decide(policy, PolicyState(), reading(0.5), "8bit", big, 0.0)
    assert decision is not None and decision.target == "bf16"
    unknown = {"8bit": GB, "bf16": None}
    assert decide(policy, PolicyState(), reading(0.1), "8bit", unknown, 0.0)[0] is None


def test_swap_mode_follows_what_fits():
    policy = Policy(make_before_break_below=0.95)
    assert choose_mode(policy, reading(0.80), GB) == MAKE_BEFORE_BREAK  # 0.90 at the peak
    assert choose_mode(policy, reading(0.86), GB) == BREAK_BEFORE_MAKE  # 0.96 > 0.95
    assert choose_mode(policy, reading(0.10), None) == BREAK_BEFORE_MAKE  # unknown: safe
    assert choose_mode(Policy(mode=BREAK_BEFORE_MAKE), reading(0.1), GB) == BREAK_BEFORE_MAKE


# -- no flapping: 60 simulated seconds of pressure around a watermark ------------------------


def _square(low: float, high: float, period: float):
    return lambda t, variant: high if (t % period) < period / 2 else low


OSCILLATIONS = {
    "fast around downgrade": (_square(0.84, 0.86, 2.0), "bf16"),
    "slow around downgrade": (_square(0.84, 0.86, 8.0), "bf16"),
    "noise around downgrade": (None, "bf16"),
    "fast around upgrade": (_square(0.64, 0.66, 2.0), "4bit"),
    "slow around upgrade": (_square(0.60, 0.70, 70.0), "4bit"),
    "between the watermarks and above": (_square(0.70, 0.90, 10.0), "bf16"),
}


@pytest.mark.parametrize("name", list(OSCILLATIONS))
def test_oscillating_pressure_makes_at_most_one_swap_per_cool_down(name):
    policy = Policy()
    pressure, start = OSCILLATIONS[name]
    if pressure is None:
        rng = random.Random(7)
        pressure = lambda t, variant: 0.85 + rng.uniform(-0.03, 0.03)  # noqa: E731
    swaps = simulate(policy, pressure, start=start, seconds=60.0)
    times = [t for t, _ in swaps]
    assert all(b - a >= policy.cooldown_s for a, b in zip(times, times[1:], strict=False)), swaps
    assert len(swaps) <= 60.0 / policy.cooldown_s, swaps


def test_a_downgrade_that_relieves_the_pressure_is_not_undone():
    """Closed loop: pressure is the rest of the host plus the active variant's footprint, and the
    rest hovers so that bf16 sits right on the downgrade watermark."""
    policy = Policy()

    def pressure(t, variant):
        rest = (6.3 if (t % 8.0) < 4.0 else 6.7) * GB
        return (rest + FOOTPRINTS[variant]) / LIMIT

    assert simulate(policy, pressure, seconds=60.0) == [(7.0, "8bit")]


# -- footprints: measured, else estimated from weight bytes ----------------------------------


def test_weight_bytes_follow_the_recipe():
    from qwen3_tts_engine.models.footprint import estimate_weight_bytes
    from qwen3_tts_engine.models.recipes import get_recipe

    tensors = {
        "talker.model.layers.0.mlp.gate_proj.weight": ((128, 64), "BF16"),  # quantizable
        "talker.model.codec_embedding.weight": ((3072, 64), "BF16"),  # always kept
        "talker.model.norm.weight": ((64,), "BF16"),
        "talker.model.layers.0.mlp.gate_proj.bias": ((128,), "F32"),
    }
    kept = 3072 * 64 * 2 + 64 * 2 + 128 * 4
    assert estimate_weight_bytes(tensors, get_recipe("bf16"), 1) == kept + 128 * 64 * 2
    # 4 bits per weight plus a bf16 scale and bias per group of 64.
    assert estimate_weight_bytes(tensors, get_recipe("4bit"), 1) == kept + 8192 // 2 + 2 * 128 * 2


def test_float32_compute_weight_bytes_match_the_loaded_talker(tiny_checkpoint):
    """With `compute_dtype="float32"` the governor's estimate of each rung grows by what the
    cast adds to the loaded talker (its non-embedding floats, quantized scales included)."""
    from qwen3_tts_engine.models.footprint import checkpoint_weight_bytes
    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.worker.loading import load
    from qwen3_tts_engine.worker.measure import model_bytes

    path = tiny_checkpoint("custom_voice")
    for variant in ("bf16", "4bit"):
        native = checkpoint_weight_bytes(path, [variant])[variant]
        wide = checkpoint_weight_bytes(path, [variant], "float32")[variant]
        loaded = [model_bytes(load(resolve(str(path), variant), progress=False, compute_dtype=c)[0])["talker_bytes"]
                  for c in (None, "float32")]  # fmt: skip
        assert wide - native == loaded[1] - loaded[0] > 0, variant


def test_footprints_prefer_measurements_and_estimate_from_them():
    from qwen3_tts_engine.models.footprint import Footprints

    fp = Footprints({"bf16": 300, "8bit": 160, "4bit": 90})
    assert fp.get("bf16") is None  # nothing measured yet
    fp.observe("bf16", {"rss_bytes": 1000})
    assert (fp.get("bf16"), fp.get("8bit"), fp.get("4bit")) == (1000, 860, 790)
    fp.observe("4bit", {"rss_bytes": 700})
    fp.observe("4bit", {"rss_bytes": 650})  # the largest seen is kept
    assert fp.get("4bit") == 700 and fp.get("8bit") == max(860, 770)
    assert Footprints().get("6bit") is None


def test_checkpoint_weight_bytes_from_safetensors_headers(tiny_checkpoint):
    from qwen3_tts_engine.models.footprint import checkpoint_weight_bytes

    rungs = ["bf16", "8bit", "4bit", "4bit-emb8", "4bit-emb4", "4bit-emb4-voc16"]
    sizes = checkpoint_weight_bytes(tiny_checkpoint("custom_voice"), rungs)
    assert [sizes[v] for v in rungs] == sorted(sizes.values(), reverse=True) and sizes[
        "4bit-emb4-voc16"
    ] > 0
    assert len(set(sizes.values())) == len(rungs)  # each rung saves something
    assert checkpoint_weight_bytes(tiny_checkpoint("custom_voice", bits=4), ["bf16"]) == {}


def test_footprints_break_a_worker_down_into_weights_runtime_and_kv():
    from qwen3_tts_engine.models.footprint import Footprints, breakdown

    parts = {"talker_bytes": 500, "speech_tokenizer_bytes": 200, "speaker_encoder_bytes": 0,
             "kv_bytes_per_frame": 3}  # fmt: skip
    b = breakdown(parts, {"rss_bytes": 1000, "mlx_cache_bytes": 7})
    assert b == {"process_bytes": 1000, "talker_bytes": 500, "speech_tokenizer_bytes": 200,
                 "speaker_encoder_bytes": 0, "runtime_bytes": 300, "kv_bytes_per_frame": 3,
                 "mlx_cache_bytes": 7}  # fmt: skip
    assert breakdown(None, {"rss_bytes": 1000})["runtime_bytes"] is None  # weights unknown
    fp = Footprints()
    fp.observe("4bit", {"rss_bytes": 1000}, parts)  # at load: the worker's breakdown
    fp.observe("4bit", {"rss_bytes": 1200})  # while serving: the larger one, same weights
    assert fp.as_dict(["4bit"])["4bit"]["parts"]["runtime_bytes"] == 500


async def test_the_governor_estimates_rungs_in_the_dtype_auto_resolved_to(tiny_checkpoint):
    """A handler asked for `auto` (serve's default) reports what its worker computes in, and the
    governor's weight estimates per rung are those of that dtype (float32 on a CPU)."""
    from qwen3_tts_engine.dispatch.engine import Engine
    from qwen3_tts_engine.dispatch.handler import Handler
    from qwen3_tts_engine.governor.governor import Governor
    from qwen3_tts_engine.governor.memory import ManualProbe
    from qwen3_tts_engine.governor.policy import Policy
    from qwen3_tts_engine.models.footprint import checkpoint_weight_bytes
    from qwen3_tts_engine.worker.cpu_kernels import on_cpu

    path = tiny_checkpoint("custom_voice")
    handler = Handler(str(path), "bf16", compute_dtype="auto")
    engine = Engine(str(path), [handler])
    governor = Governor(engine, ManualProbe(), Policy(ladder=("bf16", "4bit")), auto=False,
                        allow_unevaluated=("all",))  # fmt: skip
    await engine.start()
    try:
        await governor.start()
        expected = "float32" if on_cpu() else None
        assert handler.compute_dtype == "auto" and handler.loaded_compute_dtype == expected
        assert governor.footprints.weight_bytes == checkpoint_weight_bytes(
            path, ["bf16", "4bit"], expected
        )
        if expected:  # the cast shows in the estimate
            assert governor.footprints.weight_bytes != checkpoint_weight_bytes(
                path, ["bf16", "4bit"]
            )
    finally:
        await governor.stop()
        await engine.stop()
