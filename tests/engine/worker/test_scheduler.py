"""Continuous batching in process: many streams on one tiny model, each as if it ran alone.

Real mlx-audio modules on a tiny random checkpoint whose utterances end by EOS after about one
frame per text token (so streams end at different frames). mlx runs on pytest's main thread.
Most tests compare codes only (`decode=False`): the mlx-cpu vocoder costs about a second per
chunk here, and a stream's audio is a function of its codes (`test_vocoder_streams.py`); one
test compares audio too.
"""

import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import FRAME_SAMPLES, RequestError, SpeechRequest
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.scheduler import Scheduler
from qwen3_tts_engine.worker.synthesis import one_shot_decode, stream_chunks

REQUESTS = {
    "a": dict(input="Hello there, how are you today?", seed=1),
    "b": dict(
        input="A much longer sentence that goes on and on. And a second one follows it.",
        seed=2,
        temperature=0.7,
        top_k=20,
    ),  # fmt: skip
    "c": dict(input="Short.", seed=3, top_p=0.8, repetition_penalty=1.3, first_chunk_frames=1),
    "d": dict(input="Numbers one two three four five six seven.", seed=4, temperature=0.0),
}


@pytest.fixture(scope="module")
def eos_model(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos="text"))), progress=False)
    return m


def _req(**kw) -> SpeechRequest:
    return SpeechRequest(voice="ryan", language="english", **kw)


def _solo(model, name: str) -> tuple[np.ndarray, list[int]]:
    chunks = list(stream_chunks(model, _req(**REQUESTS[name]), decode=False))
    return np.concatenate([c.codes for c in chunks]), [c.frames for c in chunks]


@pytest.fixture(scope="module")
def solo(eos_model):
    return {name: _solo(eos_model, name) for name in REQUESTS}


def _drive(scheduler: Scheduler, plan: dict[int, list], until_done: set[str]) -> dict:
    """Step the scheduler; `plan` maps a step number to actions run before it. Returns each
    stream's chunks and how it ended."""
    out: dict[str, dict] = {}
    step = 0
    while not until_done <= {k for k, v in out.items() if "end" in v}:
        for action in plan.get(step, []):
            action()
        for ev in scheduler.step():
            rec = out.setdefault(ev.stream.id, {"chunks": [], "batch": []})
            if ev.kind == "chunk":
                rec["chunks"].append(ev.chunk)
                rec["batch"].append(len(scheduler.rows))
            else:
                rec["end"] = ev.kind if ev.kind == "done" else ev.error
                rec["stats"] = ev.stream.stats
        step += 1
        assert step < 2000, "the streams did not end"
    return out


def test_streams_of_different_settings_batched_equal_their_solo_runs(eos_model, solo):
    _batched_equals_solo(eos_model, solo)


def test_float32_compute_batched_equals_its_solo_runs(tiny_checkpoint, eos_model):
    """`compute_dtype="float32"` (mlx-cpu's fast matmuls): the talker's weights are float32,
    the vocoder's are what they were, and batching still changes no seeded stream's codes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos="text"))), progress=False,
                    compute_dtype="float32")  # fmt: skip
    before = dict(tree_flatten(eos_model.talker.parameters()))
    after = dict(tree_flatten(model.talker.parameters()))
    tables = {k for k in after if "embedding" in k}  # embedding tables keep their dtype
    assert tables and all(after[k].dtype == before[k].dtype == mx.bfloat16 for k in tables)
    rest = {
        after[k].dtype
        for k in after
        if k not in tables and mx.issubdtype(after[k].dtype, mx.floating)
    }
    assert rest == {mx.float32}
    assert mx.bfloat16 in {
        before[k].dtype for k in before if k not in tables
    }  # what the option changed
    vocoder = lambda m: {v.dtype for _, v in tree_flatten(m.speech_tokenizer.decoder.parameters())}  # noqa: E731
    assert vocoder(model) == vocoder(eos_model)
    _batched_equals_solo(model, {name: _solo(model, name) for name in REQUESTS})


def test_auto_compute_is_float32_on_the_cpu_backend_only(tiny_checkpoint):
    """`serve`'s default `--compute-dtype auto`: float32 where mlx runs on the CPU, the weights'
    dtype on a GPU; the loader says which it used (the worker reports it, the governor reads it)."""
    import mlx.core as mx

    from qwen3_tts_engine.worker.cpu_kernels import on_cpu
    from qwen3_tts_engine.worker.loading import resolve_compute_dtype

    expected = "float32" if on_cpu() else None
    assert resolve_compute_dtype("auto") == expected
    assert resolve_compute_dtype(None) is None and resolve_compute_dtype("float32") == "float32"
    model, details = load(
        resolve(str(tiny_checkpoint("custom_voice"))), progress=False, compute_dtype="auto"
    )
    assert details["compute_dtype"] == expected
    weight = model.talker.model.layers[0].mlp.gate_proj.weight
    assert weight.dtype == (mx.float32 if expected else mx.bfloat16)


def test_an_unknown_compute_dtype_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="float32"):
        load(resolve(str(tiny_checkpoint("custom_voice"))), progress=False, compute_dtype="bfloat8")


def _batched_equals_solo(model, solo) -> None:
    lengths = {name: len(codes) for name, (codes, _) in solo.items()}
    assert len(set(lengths.values())) == len(lengths), lengths  # they end at different frames
    scheduler = Scheduler(model, max_batch=8)
    for name in ("a", "b"):
        scheduler.add(name, _req(**REQUESTS[name]), decode=False)
    # c and d join while a and b are running
    plan = {3: [lambda: scheduler.add("c", _req(**REQUESTS["c"]), decode=False)],
            6: [lambda: scheduler.add("d", _req(**REQUESTS["d"]), decode=False)]}  # fmt: skip
    out = _drive(scheduler, plan, set(REQUESTS))
    assert max(scheduler.batch_sizes) == 4
    for name, (codes, frames) in solo.items():
        rec = out[name]
        assert rec["end"] == "done" and not rec["stats"].hit_token_cap
        assert [c.frames for c in rec["chunks"]] == frames
        first = REQUESTS[name].get("first_chunk_frames", 4)
        assert frames[0] == min(first, len(codes)) and all(f == 4 for f in frames[1:-1])
        np.testing.assert_array_equal(np.concatenate([c.codes for c in rec["chunks"]]), codes)
    assert scheduler.cache is None and not scheduler.streams  # every row left


def test_a_cancelled_stream_leaves_the_others_unchanged(eos_model, solo):
    scheduler = Scheduler(eos_model, max_batch=8)
    for name in ("a", "b", "d"):
        scheduler.add(name, _req(**REQUESTS[name]), decode=False)
    out = _drive(scheduler, {5: [lambda: scheduler.cancel("b")]}, {"a", "b", "d"})
    assert out["b"]["stats"].cancelled and out["b"]["end"] == "done"
    made = sum(c.frames for c in out["b"]["chunks"])
    assert 0 < made < len(solo["b"][0])
    for name in ("a", "d"):
        np.testing.assert_array_equal(np.concatenate([c.codes for c in out[name]["chunks"]]),
                                      solo[name][0])  # fmt: skip


def test_a_paused_stream_resumes_where_it_stopped(eos_model, solo):
    """Flow control takes a stream's row out of the batch and merges it back later."""
    scheduler = Scheduler(eos_model, max_batch=8)
    for name in ("b", "d"):
        scheduler.add(name, _req(**REQUESTS[name]), decode=False)
    plan = {4: [lambda: scheduler.set_paused("b", True)],
            12: [lambda: scheduler.set_paused("b", False)]}  # fmt: skip
    out = _drive(scheduler, plan, {"b", "d"})
    assert min(out["d"]["batch"]) == 1  # d ran alone while b was paused
    for name in ("b", "d"):
        np.testing.assert_array_equal(np.concatenate([c.codes for c in out[name]["chunks"]]),
                                      solo[name][0])  # fmt: skip


def test_max_batch_holds_the_rest_back(eos_model, solo):
    scheduler = Scheduler(eos_model, max_batch=2)
    for name in REQUESTS:
        scheduler.add(name, _req(**REQUESTS[name]), decode=False)
    out = _drive(scheduler, {}, set(REQUESTS))
    assert max(scheduler.batch_sizes) == 2
    for name in REQUESTS:
        np.testing.assert_array_equal(np.concatenate([c.codes for c in out[name]["chunks"]]),
                                      solo[name][0])  # fmt: skip


def test_a_bad_request_is_refused_and_a_failing_one_fails_alone(eos_model, solo):
    scheduler = Scheduler(eos_model)
    with pytest.raises(RequestError, match="unknown voice"):
        scheduler.add("x", SpeechRequest(input="Hi.", voice="nobody"))
    scheduler.add("a", _req(**REQUESTS["a"]), decode=False)
    broken = scheduler.add("bad", _req(input="Fine so far.", seed=5), decode=False)
    broken.sentences = [None]  # its prefill raises inside the step
    out = _drive(scheduler, {}, {"a", "bad"})
    assert isinstance(out["bad"]["end"], Exception)
    np.testing.assert_array_equal(
        np.concatenate([c.codes for c in out["a"]["chunks"]]), solo["a"][0]
    )


def test_greedy_rows_do_not_depend_on_the_seed(eos_model):
    """temperature 0 is greedy (as mlx-audio's sampler): two seeds, the same codes."""
    runs = [np.concatenate([c.codes for c in stream_chunks(
        eos_model, _req(input="The same every time.", temperature=temperature, seed=seed),
        decode=False)]) for temperature, seed in ((0.0, 1), (0.0, 2), (0.9, 2))]  # fmt: skip
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[2][: len(runs[0])], runs[0][: len(runs[2])])


def test_batched_audio_equals_solo_audio_and_a_one_shot_decode(eos_model, solo):
    """Each stream's vocoder state is its own: two streams decoded in the same steps give the
    audio each gives alone, which is also one windowed decode of its codes (no seams)."""
    names = ("a", "c")
    alone = {n: list(stream_chunks(eos_model, _req(**REQUESTS[n]), keep_codes=True)) for n in names}
    scheduler = Scheduler(eos_model)
    for name in names:
        scheduler.add(name, _req(**REQUESTS[name]), keep_codes=True)
    out = _drive(scheduler, {}, set(names))
    for name in names:
        codes = np.concatenate([c.codes for c in out[name]["chunks"]])
        np.testing.assert_array_equal(codes, solo[name][0])
        audio = np.concatenate([c.audio for c in out[name]["chunks"]])
        assert audio.shape == (len(codes) * FRAME_SAMPLES,) and np.abs(audio).max() > 1e-3
        np.testing.assert_allclose(
            audio, np.concatenate([c.audio for c in alone[name]]), atol=1e-5, rtol=0
        )
        np.testing.assert_allclose(audio, one_shot_decode(eos_model, codes), atol=2e-4, rtol=0)
