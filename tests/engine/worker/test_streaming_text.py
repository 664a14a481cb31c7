"""Dual-track synthesis and text streamed in while speech is made, in the scheduler.

Real mlx-audio modules on the tiny checkpoint whose utterances end by EOS. In the dual-track
layout its EOS logit rises within a few frames of the start (it counts text positions in the
prompt, and dual-track puts one there), so a stream that ends only after its whole text shows
the engine's rule: no EOS before `tts_eos` has been fed. Order is shown by scheduler state and
counters, step by step; nothing here depends on time.
"""

import mlx.core as mx
import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import RequestError, SpeechRequest
from qwen3_tts_engine.worker.incremental_text import text_token_ids
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.sampling import BatchSampler, SamplingParams, eos_suppression
from qwen3_tts_engine.worker.scheduler import Scheduler
from qwen3_tts_engine.worker.text_track import MIN_FRAMES

TEXT = "Hello there, how are you today? Numbers 1, 2 and 3."
OTHER = "A second stream speaks its whole sentence meanwhile."


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos="text"))), progress=False)
    return m


def _req(**kw) -> SpeechRequest:
    kw.setdefault("input", "")
    return SpeechRequest(voice="ryan", language="english", **kw)


class Run:
    """Steps a scheduler, collecting each stream's codes and how it ended."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.codes: dict[str, list[np.ndarray]] = {}
        self.ended: dict[str, object] = {}
        self.streams: dict[str, object] = {}
        self.steps = 0

    def step(self) -> None:
        for ev in self.s.step():
            self.streams[ev.stream.id] = ev.stream
            if ev.kind == "chunk":
                self.codes.setdefault(ev.stream.id, []).append(ev.chunk.codes)
            else:
                self.ended[ev.stream.id] = ev.kind if ev.kind == "done" else ev.error
        self.steps += 1
        assert self.steps < 3000, "the streams did not end"

    def until_ended(self, *ids: str) -> None:
        while not set(ids) <= set(self.ended):
            self.step()

    def frames(self, sid: str) -> np.ndarray:
        return np.concatenate(self.codes[sid]) if sid in self.codes else np.zeros((0, 16), int)


def _whole(model, text: str, seed: int, **kw) -> tuple[np.ndarray, object]:
    run = Run(Scheduler(model, max_batch=4))
    run.s.add("w", _req(input=text, seed=seed, text_mode="dual", **kw), decode=False)
    run.until_ended("w")
    assert run.ended["w"] == "done"
    return run.frames("w"), run.streams["w"]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_pieces_give_the_codes_of_the_whole_text(model, size):
    """The same text pushed in pieces, with steps between them (the stream waits for text
    again and again), gives the codes of the whole text given at once; batched with another
    stream too. The ids fed are the final text's."""
    whole, whole_stream = _whole(model, TEXT, seed=5)
    ids = text_token_ids(model.tokenizer, TEXT)
    assert whole_stream.stats.text_tokens == len(ids) and whole_stream.text.fed_ids == ids
    # N text tokens: t0 in the prompt, t1..tN-1 and tts_eos with frames 0..N-1, so frame N is
    # the first that may be EOS; this checkpoint's EOS logit is high from a few frames on in
    # dual-track, so EOS comes exactly there (without the rule it would at frame 2 or 3)
    assert len(whole) == len(ids)
    for batched in (False, True):
        run = Run(Scheduler(model, max_batch=4))
        if batched:
            run.s.add("other", _req(input=OTHER, seed=9), decode=False)
        run.s.add("s", _req(text_stream=True, seed=5), decode=False)
        for i, piece in enumerate(_pieces(TEXT, size)):
            run.s.append_text("s", piece)
            for _ in range(i % 4):  # 0-3 steps between pieces
                run.step()
        run.s.end_text("s")
        run.until_ended("s", *(["other"] if batched else []))
        assert run.ended["s"] == "done"
        np.testing.assert_array_equal(run.frames("s"), whole)
        stream = run.streams["s"]
        assert stream.text.fed_ids == ids and stream.stats.text_tokens == len(ids)
        assert stream.stats.text_waits > 0 and run.s.text_resumes >= stream.stats.text_waits


def test_a_starving_stream_leaves_the_batch_and_rejoins_while_another_speaks(model):
    run = Run(Scheduler(model, max_batch=4))
    run.s.add("other", _req(input=OTHER, seed=2), decode=False)
    run.s.add("s", _req(text_stream=True, seed=3), decode=False)
    run.s.append_text("s", "Hello there, how")  # commits "Hello there," (3 tokens or so)
    while "s" not in run.streams or not run.streams["s"].waiting_text:
        run.step()
    s = run.streams["s"]
    frames_at_wait = s.stats.frames
    assert frames_at_wait == len(s.text.fed_ids)  # one text token per frame, then it waits
    assert s not in run.s.rows and s.parked is not None and run.s.text_waits == 1
    other_before = run.frames("other").shape[0]
    for _ in range(12):  # the other stream goes on; the waiting one makes nothing
        run.step()
        assert s not in run.s.rows
    assert run.frames("other").shape[0] > other_before or "other" in run.ended
    assert s.stats.frames == frames_at_wait and "s" not in run.ended
    assert run.frames("s").shape[0] == frames_at_wait  # its pending frames were flushed
    run.s.append_text("s", " are you?")
    assert not s.waiting_text and run.s.text_resumes == 1  # its token came: it may rejoin
    run.step()
    assert s in run.s.rows and s.stats.frames == frames_at_wait + 1
    run.s.end_text("s")
    run.until_ended("s", "other")
    assert run.ended["s"] == "done" and not s.stats.hit_token_cap


def test_no_eos_while_the_text_is_open(model):
    """All the text is there but not its end: the stream feeds every token, then waits for
    more instead of ending; after `end` it feeds tts_eos and ends by EOS."""
    run = Run(Scheduler(model, max_batch=2))
    run.s.add("s", _req(text_stream=True, seed=4), decode=False)
    run.s.append_text("s", "Short text here ")
    while "s" not in run.streams or not run.streams["s"].waiting_text:
        run.step()
    s = run.streams["s"]
    assert not run.s.runnable  # nothing to compute: the worker blocks for messages
    fed = list(s.text.fed_ids)
    run.s.end_text("s")
    assert not s.text.eos_fed
    run.until_ended("s")
    assert run.ended["s"] == "done" and not s.stats.hit_token_cap
    assert s.text.eos_fed and s.text.fed_ids == text_token_ids(model.tokenizer, "Short text here ")
    assert s.stats.frames == len(s.text.fed_ids) > len(fed)  # EOS at the first frame allowed


def test_the_start_threshold_holds_the_first_frame_back(model):
    run = Run(Scheduler(model, max_batch=2))
    run.s.add("s", _req(text_stream=True, seed=4, text_start_tokens=4), decode=False)
    run.s.append_text("s", "One two ")  # "One", " two" committed? " two" is held (last chunk)
    stream = run.s.streams["s"]
    assert len(stream.feed.ids) < 4 and not run.s.runnable
    run.step()
    assert stream.text is None and stream.stats.frames == 0
    run.s.append_text("s", "three four five")
    assert len(stream.feed.ids) >= 4 and run.s.runnable
    run.step()
    assert stream.stats.frames == 1 and stream.text.fed_ids[0] == stream.feed.ids[0]
    run.s.end_text("s")
    run.until_ended("s")
    assert run.ended["s"] == "done"


def test_pacing_feeds_at_most_the_paced_tokens_per_frame(model):
    codes, stream = _whole(model, TEXT, seed=5, text_pace=0.5)
    ids = text_token_ids(model.tokenizer, TEXT)
    assert stream.text.fed_ids == ids
    assert len(codes) >= 2 * len(ids)  # one token every other frame, EOS after tts_eos


def test_a_stream_waiting_for_text_is_cancelled_at_once(model):
    run = Run(Scheduler(model, max_batch=2))
    run.s.add("s", _req(text_stream=True, seed=4), decode=False)
    run.s.append_text("s", "Hello there friend")
    while "s" not in run.streams or not run.streams["s"].waiting_text:
        run.step()
    run.s.cancel("s")
    run.step()
    assert run.ended["s"] == "done" and run.streams["s"].stats.cancelled
    assert not run.s.streams and not run.s.rows


def test_streaming_refusals(model, tiny_checkpoint):
    s = Scheduler(model)
    with pytest.raises(RequestError, match="text_mode"):
        s.add("a", _req(text_stream=True, text_mode="prompt"))
    run = Run(s)
    run.s.add("b", _req(text_stream=True))
    run.s.end_text("b")  # no text at all
    run.until_ended("b")
    assert isinstance(run.ended["b"], RequestError) and run.ended["b"].status == 400


def test_eos_is_suppressed_row_by_row_at_sampling():
    """Logits where EOS is by far the likeliest id: rows that may not end never draw it."""
    vocab, eos = 64, 7
    logits = np.zeros((4, vocab), np.float32)
    logits[:, eos] = 50.0
    base = np.zeros(vocab, np.bool_)
    base[60:] = True
    allowed = [True, False, True, False]
    mask = eos_suppression(mx.array(base), eos, allowed)
    assert mask.shape == (4, vocab)
    sampler = BatchSampler([SamplingParams(temperature=1.0, top_k=0)] * 4, vocab)
    for u in np.linspace(0.001, 0.999, 25):
        ids = np.array(sampler.sample(mx.array(logits), mx.full((4,), float(u)), suppress=mask))[
            :, 0
        ]
        assert (ids[[0, 2]] == eos).all() and (ids[[1, 3]] != eos).all() and (ids < 60).all()
    assert eos_suppression(mx.array(base), eos, [True, True]) is not None


def test_eos_rules_of_the_text_track(model):
    from qwen3_tts_engine.rules import check_request
    from qwen3_tts_engine.worker.text_track import TextTrack

    for mode in ("prompt", "dual"):
        track = TextTrack(model, _req(input="Hi there.", text_mode=mode), mode, text="Hi there.")
        voice = check_request(_req(input="x"), Scheduler(model).info)
        track.prompt(voice, None)
        assert [track.eos_allowed(f) for f in range(MIN_FRAMES)] == [False] * MIN_FRAMES
        assert track.eos_allowed(MIN_FRAMES) == (mode == "prompt")  # dual: not before tts_eos
        for frame in range(len(track.trailing)):
            assert track.term(frame) is not None
        assert track.eos_allowed(max(MIN_FRAMES, len(track.trailing) + 1))
