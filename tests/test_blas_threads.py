"""The talker's steps run on one OpenBLAS thread where its matmuls are small, and the thread
count comes back afterwards (the vocoder's larger matmuls keep every thread)."""

from __future__ import annotations

import os

import pytest

from qwen3_tts_engine.models import blas_threads as bt


def _threads() -> int:
    return bt._openblas()[1]()


@pytest.fixture
def openblas():
    if "openblas" not in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("OpenBLAS is not preloaded here (the test command preloads it on Linux)")
    assert bt.available(), "LD_PRELOAD names OpenBLAS but its thread functions are not found"
    return bt


def test_one_thread_inside_and_the_count_restored_after(openblas):
    bt._openblas()[0](2)  # as on a 2-core machine, whatever this one has
    before = _threads()
    assert before == 2
    with openblas.blas_threads(1):
        assert _threads() == 1
    assert _threads() == before
    with openblas.blas_threads(None):  # leave it alone
        assert _threads() == before
    with pytest.raises(RuntimeError), openblas.blas_threads(1):
        raise RuntimeError("the block failed")
    assert _threads() == before


def test_only_small_models_step_on_one_thread():
    assert bt.threads_for(64 * 128) == 1  # the tiny checkpoint's talker MLP
    assert bt.threads_for(1024 * 3072) is None  # the real 0.6B talker's


def test_the_scheduler_of_the_tiny_checkpoint_steps_on_one_thread(openblas, tiny_checkpoint):
    from qwen3_tts_engine.models.loading import load
    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.protocol import SpeechRequest
    from qwen3_tts_engine.runtime import scheduler as sched

    model, _ = load(resolve(str(tiny_checkpoint("custom_voice"))), progress=False)
    s = sched.Scheduler(model, max_batch=2)
    assert s.step_threads == 1
    bt._openblas()[0](2)
    seen = []
    talker_step = s._talker_step
    s._talker_step = lambda joining: (seen.append(_threads()), talker_step(joining))[1]
    before = _threads()
    s.add("a", SpeechRequest(input="Hello.", voice="ryan", seed=1, max_new_tokens=2), decode=False)
    while s.streams:
        s.step()
    assert seen and set(seen) == {1} and _threads() == before == 2
