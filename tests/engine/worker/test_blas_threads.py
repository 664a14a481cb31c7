"""The talker's steps run on one OpenBLAS thread where its matmuls are small, and the thread
count comes back afterwards (the vocoder's larger matmuls keep every thread)."""

from __future__ import annotations

import os

import pytest

from qwen3_tts_engine.fast_blas import use_fast_blas
from qwen3_tts_engine.worker import blas_threads as bt


def _threads() -> int:
    return bt._openblas()[1]()


@pytest.fixture
def openblas():
    """OpenBLAS at 2 threads (as on a 2-core machine, whatever this one has); its count and
    this thread's CPU affinity as they were afterwards."""
    if use_fast_blas() is None:  # tests/conftest.py loaded it already, where there is one
        pytest.skip("no OpenBLAS here (Debian: libopenblas0-pthread; macOS runs mlx on Metal)")
    assert bt.available(), "OpenBLAS is loaded but its thread functions are not found"
    setter = bt._openblas()[0]
    before, affinity = _threads(), os.sched_getaffinity(0)
    setter(2)
    yield bt
    assert os.sched_getaffinity(0) == affinity  # switching thread counts left it alone
    setter(before)


def test_one_thread_inside_and_the_count_restored_after(openblas):
    assert _threads() == 2
    with openblas.blas_threads(1):
        assert _threads() == 1
    assert _threads() == 2
    with openblas.blas_threads(None):  # leave it alone
        assert _threads() == 2
    with pytest.raises(RuntimeError), openblas.blas_threads(1):
        raise RuntimeError("the block failed")
    assert _threads() == 2


def test_only_small_models_step_on_one_thread():
    assert bt.threads_for(64 * 128) == 1  # the tiny checkpoint's talker MLP
    assert bt.threads_for(1024 * 3072) is None  # the real 0.6B talker's


def test_the_tiny_checkpoints_steps_evaluate_on_one_thread(openblas, tiny_checkpoint, monkeypatch):
    """Where the step's graph is evaluated (mx.eval, .item()), not only where it is built."""
    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.protocol import SpeechRequest
    from qwen3_tts_engine.worker import scheduler as sched
    from qwen3_tts_engine.worker.loading import load

    model, _ = load(resolve(str(tiny_checkpoint("custom_voice"))), progress=False)
    s = sched.Scheduler(model, max_batch=2)
    assert s.step_threads == 1
    seen = []
    evaluate = sched.mx.eval
    monkeypatch.setattr(sched.mx, "eval", lambda *a: (seen.append(_threads()), evaluate(*a))[1])
    for name in ("a", "b"):  # two rows: OpenBLAS would split their matmuls
        s.add(
            name,
            SpeechRequest(input=f"Hello {name}.", voice="ryan", seed=1, max_new_tokens=3),
            decode=False,
        )
    while s.streams:
        s.step()
    assert len(seen) >= 3 and set(seen) == {1}
    assert _threads() == 2
