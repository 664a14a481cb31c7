"""A request's own failure inside the worker ends that request only (issue 43, item 1).

The scheduler in process, on the tiny checkpoint whose utterances end by EOS: a stream whose
streamed text the tokenizer cannot take (a lone surrogate: the server refuses it, but the worker
must not depend on that), or whose row fails while it is stepped, ends with an "error" event;
its neighbours in the batch give the codes they give alone and the scheduler goes on. Order is
shown by scheduler state, step by step; nothing here depends on time.
"""

import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.scheduler import Scheduler
from qwen3_tts_engine.worker.synthesis import stream_chunks

NEIGHBOUR = dict(input="A neighbour speaks its whole sentence, and then another one after it.",
                 seed=7)  # fmt: skip
STREAMED = "Hello there, how are you today? Fine, thanks, and you? "


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos="text"))), progress=False)
    return m


@pytest.fixture(scope="module")
def alone(model) -> np.ndarray:
    """The neighbour's codes, spoken alone."""
    return np.concatenate([c.codes for c in stream_chunks(model, _req(**NEIGHBOUR), decode=False)])


def _req(**kw) -> SpeechRequest:
    kw.setdefault("input", "")
    return SpeechRequest(voice="ryan", language="english", **kw)


class Run:
    """Steps a scheduler, collecting each stream's codes and how it ended."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.codes: dict[str, list[np.ndarray]] = {}
        self.ended: dict[str, object] = {}
        self.together = 0  # steps whose batch held both streams of the test
        self.steps = 0

    def step(self) -> None:
        events = self.s.step()
        self.together += {"n", "s"} <= {r.id for r in self.s.rows}
        for ev in events:
            if ev.kind == "chunk":
                self.codes.setdefault(ev.stream.id, []).append(ev.chunk.codes)
            else:
                self.ended[ev.stream.id] = ev.kind if ev.kind == "done" else ev.error
        self.steps += 1
        assert self.steps < 3000, "the streams did not end"

    def until(self, predicate) -> None:
        while not predicate():
            self.step()

    def frames(self, sid: str) -> np.ndarray:
        return np.concatenate(self.codes[sid]) if sid in self.codes else np.zeros((0, 16), int)


def _batched(model) -> Run:
    """A neighbour "n" and a streamed-text stream "s", both speaking in one batch."""
    run = Run(Scheduler(model, max_batch=4))
    run.s.add("n", _req(**NEIGHBOUR), decode=False)
    run.s.add("s", _req(text_stream=True, seed=3), decode=False)
    run.s.append_text("s", STREAMED)
    run.until(lambda: run.together)
    return run


@pytest.mark.parametrize("when", ["speaking", "before its start", "at its end"])
def test_streamed_text_the_tokenizer_refuses_fails_its_stream_alone(model, alone, when):
    """A lone surrogate in a streamed piece (the tokenizer cannot encode it): appended while the
    stream speaks beside its neighbour, before it has started, or held back until the text's end.
    That stream ends with an error at the next step; the neighbour's codes are those it gives
    alone; the scheduler takes no more text for it and serves the next request."""
    if when == "speaking":
        run = _batched(model)
        assert run.s.append_text("s", "and then \ud83d more") is None
    else:
        run = Run(Scheduler(model, max_batch=4))
        run.s.add("n", _req(**NEIGHBOUR), decode=False)
        run.s.add("s", _req(text_stream=True, seed=3, text_start_tokens=64), decode=False)
        run.until(lambda: "n" in run.codes)  # the neighbour speaks; "s" waits for 64 tokens
        if when == "before its start":
            assert run.s.append_text("s", "Hi \ud83d there") is None
        else:
            run.s.streams["s"].feed._pending += "\ud83d"  # held back: tokenized at the end only
            assert run.s.end_text("s") is None
    run.step()
    assert isinstance(run.ended["s"], UnicodeError | TypeError), run.ended["s"]
    assert "s" not in run.s.streams and all(r.id != "s" for r in run.s.rows)
    assert run.s.append_text("s", "more") is None and run.s.end_text("s") is None
    run.until(lambda: "n" in run.ended)
    assert run.ended["n"] == "done"
    np.testing.assert_array_equal(run.frames("n"), alone)
    # the next request on the same scheduler is served
    run.s.add("next", _req(**NEIGHBOUR), decode=False)
    run.until(lambda: "next" in run.ended)
    assert run.ended["next"] == "done"
    np.testing.assert_array_equal(run.frames("next"), alone)


def test_a_row_that_fails_while_stepped_leaves_the_batch_alone(model, alone):
    """An exception in one row's own part of a step (its text track) ends that stream with the
    error; the batch goes on and the neighbour's codes are those it gives alone."""
    run = _batched(model)
    track = run.s.streams["s"].text

    def broken(frame):
        raise RuntimeError("this row's text track broke")

    track.term = broken
    run.step()
    assert isinstance(run.ended["s"], RuntimeError) and "s" not in run.s.streams
    assert [r.id for r in run.s.rows] == ["n"]
    run.until(lambda: "n" in run.ended)
    assert run.ended["n"] == "done"
    np.testing.assert_array_equal(run.frames("n"), alone)
