"""What a stream holds in memory (models/stream_memory.py): the arithmetic from a checkpoint's
config, against the tiny checkpoint's real caches as the worker's scheduler fills them, and the
real 0.6B architecture's numbers; and a request's frame budget, as the worker caps it."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from qwen3_tts_engine.models.stream_memory import (
    KV_STEP,
    PROMPT_POSITIONS,
    StreamLayout,
    frame_budget,
    kv_positions,
)
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import Limits, SpeechRequest, default_max_new_tokens


def _configs(path) -> tuple[dict, dict]:
    root = json.loads((path / "config.json").read_text())
    st = json.loads((path / "speech_tokenizer" / "config.json").read_text())
    return root["talker_config"], st["decoder_config"]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from qwen3_tts_engine.worker.loading import load

    path = tiny_checkpoint("custom_voice", eos="never")
    model, _ = load(resolve(str(path)), progress=False)
    return path, model


def test_the_layout_from_the_tiny_checkpoints_config_is_what_its_worker_runs(tiny):
    """From config.json in the weights' dtype (bfloat16): the worker's own layout of the loaded
    model (what it reports to the server) is the same."""
    from qwen3_tts_engine.worker.measure import stream_layout

    path, model = tiny
    talker, decoder = _configs(path)
    layout = StreamLayout.from_config(talker, 2, decoder, 4)
    cp = talker["code_predictor_config"]
    assert layout.talker_kv_per_frame == (
        talker["num_hidden_layers"] * 2 * talker["num_key_value_heads"] * talker["head_dim"] * 2
    )
    assert (
        layout.predictor_kv
        == KV_STEP * cp["num_hidden_layers"] * 2 * cp["num_key_value_heads"] * cp["head_dim"] * 2
    )
    assert layout.vocoder_kv == (decoder["sliding_window"] - 1) * decoder["num_hidden_layers"] * 2 * decoder[
        "num_key_value_heads"
    ] * decoder["head_dim"] * 4  # fmt: skip
    assert stream_layout(model) == layout


def test_the_talker_and_code_predictor_caches_hold_what_the_layout_says(tiny):
    """The worker's scheduler, three streams: the batch's talker cache is rows x the positions
    allocated (one growth step: prompt and frames fit) x the bytes per frame; the code
    predictor's cache of one step is its layout bytes per row."""
    from qwen3_tts_engine.worker.measure import stream_layout
    from qwen3_tts_engine.worker.scheduler import Scheduler

    _, model = tiny
    layout = stream_layout(model)
    scheduler = Scheduler(model, max_batch=3)
    for k in range(3):
        scheduler.add(str(k), SpeechRequest(input="Count the cache, please.", voice="ryan",
                                            seed=k, max_new_tokens=6), decode=False)  # fmt: skip
    for _ in range(3):
        scheduler.step()
    cache = scheduler.cache[0]
    assert cache.keys.shape[2] == KV_STEP == kv_positions(6)  # prompt + 6 frames: one step
    assert scheduler.kv_bytes() == 3 * KV_STEP * layout.talker_kv_per_frame
    assert scheduler.kv_bytes() == layout.batch_bytes([6, 6, 6]) - 3 * layout.per_stream()

    predictor = model.talker.code_predictor
    hidden = model.talker.config.hidden_size
    dtype = model.talker.model.norm.weight.dtype
    code_cache = predictor.make_cache()
    out, code_cache, _ = predictor(mx.zeros((1, 2, hidden), dtype), cache=code_cache,
                                   generation_step=0)  # fmt: skip
    mx.eval(out)
    assert sum(c.keys.nbytes + c.values.nbytes for c in code_cache) == layout.predictor_kv


def test_the_real_0_6b_architecture():
    """The real 0.6B (`bench.memory.real_size_config`), bfloat16 talker, float32 vocoder: 112 KiB
    a frame in the talker's cache (~0.5 GB a stream at the 4096-frame cap), 5 MiB of code
    predictor cache and 4.4 MiB of vocoder window per stream."""
    from mlx_audio.tts.models.qwen3_tts.config import Qwen3TTSTokenizerDecoderConfig

    from qwen3_tts_engine.bench.memory import real_size_config

    decoder = Qwen3TTSTokenizerDecoderConfig().__dict__
    layout = StreamLayout.from_config(real_size_config()["talker_config"], 2, decoder, 4)
    assert layout.talker_kv_per_frame == 28 * 2 * 8 * 128 * 2 == 114_688
    assert layout.predictor_kv == 256 * 5 * 2 * 8 * 128 * 2
    assert layout.vocoder_kv == 71 * 8 * 2 * 16 * 64 * 4
    cap = kv_positions(Limits.max_new_tokens)
    assert cap == 4352 and 499e6 < cap * layout.talker_kv_per_frame < 500e6
    wide = StreamLayout.from_config(real_size_config()["talker_config"], 4, decoder, 4)
    assert wide.talker_kv_per_frame == 2 * layout.talker_kv_per_frame  # float32 compute


def test_a_batch_holds_every_row_as_long_as_the_longest():
    layout = StreamLayout(talker_kv_per_frame=100, predictor_kv=10, vocoder_kv=5, chunk_transient=1)
    assert (
        kv_positions(0) == KV_STEP and kv_positions(KV_STEP - PROMPT_POSITIONS + 1) == 2 * KV_STEP
    )
    assert layout.stream_bytes(8) == KV_STEP * 100 + 16
    assert layout.batch_bytes([]) == 0
    assert layout.batch_bytes([8, 300]) == 2 * (2 * KV_STEP * 100 + 16)  # left padding
    assert StreamLayout.from_dict({**layout.as_dict(), "other": 3}) == layout


def test_a_requests_frame_budget_is_the_workers_cap():
    two = "The first sentence is here. And a second, longer sentence follows it right away."
    assert frame_budget(SpeechRequest(input=two, max_new_tokens=40), "prompt") == 40
    # streamed text is open: its length is not known, the global cap holds
    assert frame_budget(SpeechRequest(input="", text_stream=True), "dual") == Limits.max_new_tokens
    # dual-track: one cache for the whole text; the prompt layout: a row per sentence
    assert frame_budget(SpeechRequest(input=two), "dual") == default_max_new_tokens(two)
    longest = default_max_new_tokens("And a second, longer sentence follows it right away.")
    assert frame_budget(SpeechRequest(input=two), "prompt") == longest < default_max_new_tokens(two)


def test_bench_memory_reads_the_layouts_bytes_per_position(tiny_checkpoint, tmp_path):
    """`qwen3-tts bench memory` as a user runs it, on the tiny checkpoint: two streams of two
    chunks; the cache's measured bytes per position are the layout's, the peak is over the memory
    after load, and the cap's figure is the peak grown by the measured slope."""
    import subprocess
    import sys
    from pathlib import Path

    path = tiny_checkpoint("custom_voice", eos="never")
    out = tmp_path / "memory.json"
    cli = Path(sys.executable).with_name("qwen3-tts")
    subprocess.run([str(cli), "bench", "memory", "--model", str(path), "--max-batch", "2",
                    "--frames", "8", "--compute-dtype", "weights", "--out", str(out)],
                   check=True, timeout=600, capture_output=True)  # fmt: skip
    report = json.loads(out.read_text())
    run = report["rungs"]["bf16"]
    layout = StreamLayout.from_dict(run["layout_bytes"])
    assert run["streams"] == 2 and run["frames_made"] == {"0": 8, "1": 8} and run["chunks"] == 4
    assert run["kv_bytes_per_position_measured"] == layout.talker_kv_per_frame
    assert {s["cache_positions"] for s in run["steps"] if s["cache_rows"]} == {KV_STEP}
    mb = run["mb"]
    assert mb["rss_peak"] >= mb["rss_after_load"] and mb["mlx_peak"] >= mb["mlx_after_load"]
    growth = (kv_positions(Limits.max_new_tokens) - KV_STEP) * layout.talker_kv_per_frame / 1e6
    assert run["at_cap"]["speaking_per_stream_mb"] == pytest.approx(
        mb["speaking"] / 2 + growth, abs=0.1
    )
