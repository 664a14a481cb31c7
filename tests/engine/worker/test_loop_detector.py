"""The loop detector (issue 51, item 3): a sentence whose codebook-0 codes cycle or stall is ended
as "repetition" well before its frame cap; normal output never is; switched off, a loop runs to
its cap ("length").

The rules alone on made-up code sequences, then the scheduler in process on tiny checkpoints:
`eos="loop"` (its talker falls into a two-code cycle and never samples EOS), `eos="text"` (ends by
EOS, as real models do) and the default (random codes, no EOS: runs to its cap). Codes only
(`decode=False`); counts of frames, never time.
"""

import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.tiny_checkpoints.builder import LOOP_CODES
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES, LoopRules, loop_kind
from qwen3_tts_engine.worker.scheduler import Scheduler, SynthesisStats
from qwen3_tts_engine.worker.synthesis import stream_chunks

RULES = DEFAULT_LOOP_RULES
CAP = 400  # frames: far above the detector's window
TEXTS = (
    "Hello there, how are you doing on this fine day, my friend?",
    "Numbers one two three four five six seven eight nine ten eleven twelve.",
    "A much longer sentence that goes on and on, and on, without any end in sight at all.",
)


# -- the rules --------------------------------------------------------------------------------


def _speech_like(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2048, n).tolist()


def test_no_verdict_before_a_whole_window():
    assert loop_kind([7] * (RULES.window - 1), RULES) is None
    assert loop_kind([7] * RULES.window, RULES) == "cycle"


@pytest.mark.parametrize("period", [1, 2, 3, RULES.max_period])
def test_a_cycle_of_up_to_max_period_frames_is_a_loop(period):
    head = _speech_like(30)
    cycle = _speech_like(period, seed=period)
    codes = head + cycle * (RULES.window // period + 1)
    assert loop_kind(codes, RULES) == "cycle"
    assert loop_kind(codes, RULES, text_fed=False) == "cycle"  # a cycle needs no text rule
    # the same cycle only in part of the window: not yet
    assert loop_kind(head + cycle * (RULES.window // (2 * period)), RULES) is None


def test_a_cycle_with_a_few_sampled_slips_is_still_a_loop_but_a_longer_period_is_not():
    codes = [1, 2] * (RULES.window // 2)
    codes[5], codes[30] = 999, 998  # two slips (four comparisons) in 46: above min_match
    assert len(set(codes)) > RULES.max_distinct  # not a stall: the cycle rule finds it
    assert loop_kind(codes, RULES) == "cycle"
    long_cycle = _speech_like(RULES.max_period + 1) * 8
    assert loop_kind(long_cycle, RULES) is None


def test_a_stall_of_a_few_codes_counts_only_once_the_text_is_all_fed():
    rng = np.random.default_rng(1)
    near_silence = rng.choice([5, 6, 9], size=RULES.window).tolist()  # sampled, no cycle
    assert loop_kind(near_silence, LoopRules(min_match=1.0)) == "stall"
    assert loop_kind(near_silence, LoopRules(min_match=1.0), text_fed=False) is None
    assert loop_kind(rng.choice(8, size=RULES.window).tolist(), RULES) is None  # 8 codes: speech


def test_speech_like_codes_never_loop():
    assert all(loop_kind(_speech_like(600, seed)[:n], RULES) is None
               for seed in range(20) for n in range(RULES.window, 600, 37))  # fmt: skip


def _by_definition(codes: list[int], rules: LoopRules, text_fed: bool) -> str | None:
    """The rules as the docs state them, with no shortcut."""
    if len(codes) < rules.window:
        return None
    w = codes[-rules.window :]
    for p in range(1, rules.max_period + 1):
        if sum(w[i] == w[i - p] for i in range(p, len(w))) >= rules.min_match * (len(w) - p) - 1e-9:
            return "cycle"
    return "stall" if text_fed and len(set(w)) <= rules.max_distinct else None


def test_skipping_windows_of_many_codes_never_changes_a_verdict():
    """`loop_kind` tests a cycle only where the window holds at most `cycle_codes` codes: random
    near-cycles with slips at the bound agree with the rules' definition."""
    rng = np.random.default_rng(7)
    rules = [RULES, LoopRules(window=20, max_period=4, min_match=0.75, max_distinct=2)]
    verdicts = set()
    for r in rules:
        for _ in range(400):
            period = int(rng.integers(1, r.max_period + 3))
            codes = (rng.integers(0, 50, period).tolist() * (r.window // period + 2))[: r.window]
            for i in rng.choice(r.window, int(rng.integers(0, 8)), replace=False):
                codes[i] = int(rng.integers(50, 60))  # slips, some of them new codes
            for fed in (True, False):
                verdicts.add(got := loop_kind(codes, r, text_fed=fed))
                assert got == _by_definition(codes, r, fed), (codes, r, fed)
    assert verdicts == {"cycle", "stall", None}  # every outcome was exercised


def test_bad_rules_are_refused():
    for bad in (dict(max_period=0), dict(max_period=48), dict(min_match=0.0),
                dict(max_distinct=0)):  # fmt: skip
        with pytest.raises(ValueError):
            LoopRules(**bad)


def test_a_stream_says_the_worst_ending_of_its_sentences():
    assert SynthesisStats().finish_reason == "stop"
    assert SynthesisStats(hit_token_cap=True).finish_reason == "length"
    assert SynthesisStats(hit_token_cap=True, repetitions=1).finish_reason == "repetition"
    assert SynthesisStats(repetitions=1, cancelled=True).finish_reason == "abort"


# -- the scheduler on tiny checkpoints ----------------------------------------------------------


def _model(tiny_checkpoint, eos: str):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos=eos))), progress=False)
    return m


@pytest.fixture(scope="module")
def looping(tiny_checkpoint):
    return _model(tiny_checkpoint, "loop")


def _run(model, text: str, rules=DEFAULT_LOOP_RULES, **kw) -> tuple[SynthesisStats, np.ndarray]:
    stats = SynthesisStats()
    req = SpeechRequest(input=text, voice="ryan", language="english", **kw)
    chunks = list(stream_chunks(model, req, decode=False, stats=stats, loop_rules=rules))
    return stats, np.concatenate([c.codes for c in chunks])


@pytest.mark.parametrize("sampling", [dict(seed=1), dict(seed=2, temperature=0.3, top_k=5)])
def test_a_looping_checkpoint_ends_as_repetition_after_one_window(looping, sampling):
    stats, codes = _run(looping, "Hello there.", max_new_tokens=CAP, **sampling)
    assert set(codes[1:, 0].tolist()) == set(LOOP_CODES)  # it does loop
    assert stats.finish_reason == "repetition" and stats.loop == "cycle"
    assert stats.frames == len(codes) == RULES.window < CAP
    assert not stats.hit_token_cap


def test_each_looping_sentence_is_ended_and_the_next_one_still_spoken(looping):
    stats, _ = _run(looping, "The first sentence is right here. And then a second one.",
                    max_new_tokens=CAP, seed=3)  # fmt: skip
    assert stats.sentences == stats.repetitions == 2
    assert stats.frames == 2 * RULES.window and stats.finish_reason == "repetition"


def test_switched_off_a_loop_runs_to_its_cap(looping):
    stats, codes = _run(looping, "Hello there.", rules=None, max_new_tokens=RULES.window + 20,
                        seed=1)  # fmt: skip
    assert stats.frames == RULES.window + 20 and stats.hit_token_cap
    assert stats.finish_reason == "length" and stats.repetitions == 0


def test_dual_track_loops_are_ended_too(looping):
    """The dual-track layout (text one token per frame; a stall counts once its text is fed)."""
    stats, _ = _run(looping, "Hello there.", max_new_tokens=CAP, seed=4, text_mode="dual")
    assert stats.text_mode == "dual"
    assert stats.finish_reason == "repetition" and stats.frames == RULES.window


@pytest.mark.slow
def test_a_checkpoint_that_ends_by_eos_never_ends_as_repetition(tiny_checkpoint):
    model = _model(tiny_checkpoint, "text")
    longest = 0
    for seed in range(4):
        for text in TEXTS:
            for sampling in (dict(), dict(temperature=0.3, top_k=5)):
                stats, _ = _run(model, text, seed=seed, **sampling)
                assert stats.finish_reason == "stop", (seed, text, sampling, stats)
                longest = max(longest, stats.frames)
    assert longest > RULES.window  # the detector saw whole windows of this output


@pytest.mark.slow
def test_random_codes_run_to_their_cap_without_a_false_stop(tiny_checkpoint):
    model = _model(tiny_checkpoint, "never")  # the builder's default: no EOS
    for seed in range(4):
        stats, _ = _run(model, TEXTS[seed % 3], seed=seed, max_new_tokens=3 * RULES.window,
                        **(dict(temperature=0.3, top_k=5) if seed % 2 else {}))  # fmt: skip
        assert stats.finish_reason == "length" and stats.frames == 3 * RULES.window, seed


def test_in_a_batch_each_looping_stream_leaves_at_its_own_window(looping):
    """Two looping streams in one batch, the second joining 10 steps later: each is ended after
    its own window of frames, and the other stays in the batch until then."""
    scheduler = Scheduler(looping, max_batch=2)
    scheduler.add("a", SpeechRequest(input="Hi.", voice="ryan", language="english", seed=1,
                                     max_new_tokens=CAP), decode=False)  # fmt: skip
    frames = {}
    for step in range(CAP):
        if step == 10:
            scheduler.add("b", SpeechRequest(input="Hi.", voice="ryan", language="english",
                                             seed=2, max_new_tokens=CAP), decode=False)  # fmt: skip
        for ev in scheduler.step():
            if ev.kind == "done":
                frames[ev.stream.id] = (step, ev.stream.stats.frames,
                                        ev.stream.stats.finish_reason)  # fmt: skip
        if len(frames) == 2:
            break
    assert frames["a"][1:] == frames["b"][1:] == (RULES.window, "repetition")
    assert frames["b"][0] - frames["a"][0] == 10  # each after its own window, not together
