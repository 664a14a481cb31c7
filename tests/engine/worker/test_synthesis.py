"""4-token streaming on a tiny checkpoint: chunk sizes, first-chunk option, no seams, cancel.

mlx runs on pytest's main thread here (safe, see docs/mlx-on-linux.md); handlers get their own processes.
"""

from pathlib import Path

import numpy as np
import pytest

from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    RequestError,
    SpeechRequest,
    default_max_new_tokens,
)
from qwen3_tts_engine.worker.loading import load
from qwen3_tts_engine.worker.synthesis import (
    SynthesisStats,
    one_shot_decode,
    stream_chunks,
)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice"))), progress=False)
    return m


def _req(**kw) -> SpeechRequest:
    kw.setdefault("voice", "ryan")
    kw.setdefault("language", "english")
    kw.setdefault("seed", 7)
    return SpeechRequest(**kw)


@pytest.mark.parametrize(
    ("first", "frames", "expected"),
    [(4, 6, [4, 2]), (1, 6, [1, 4, 1]), (2, 6, [2, 4]), (4, 8, [4, 4])],
)
def test_chunk_sizes(model, first, frames, expected):
    chunks = list(stream_chunks(model, _req(input="Hello there.", max_new_tokens=frames,
                                            first_chunk_frames=first)))  # fmt: skip
    assert [c.frames for c in chunks] == expected
    assert [c.audio.shape[0] for c in chunks] == [f * FRAME_SAMPLES for f in expected]
    assert all(np.isfinite(c.audio).all() for c in chunks)


@pytest.mark.parametrize("first", [4, 1])
def test_streamed_chunks_equal_one_shot_decode(model, first):
    chunks = list(stream_chunks(model, _req(input="No seams here, please.", max_new_tokens=9,
                                            first_chunk_frames=first), keep_codes=True))  # fmt: skip
    streamed = np.concatenate([c.audio for c in chunks])
    codes = np.concatenate([c.codes for c in chunks])
    assert codes.shape == (9, 16)
    reference = one_shot_decode(model, codes)
    assert reference.shape == streamed.shape
    assert np.abs(reference).max() > 1e-3  # the comparison is not between two silences
    np.testing.assert_allclose(streamed, reference, atol=2e-4, rtol=0)


def test_same_seed_same_codes_other_seed_differs(model):
    def run(seed):
        return np.concatenate([c.codes for c in stream_chunks(
            model, _req(input="Seeded.", max_new_tokens=12, seed=seed, temperature=0.9),
            decode=False)])  # fmt: skip

    a, b, c = run(1), run(1), run(2)
    assert a.shape == (12, 16)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_long_input_is_split_into_sentences_without_gaps(model):
    text = ("The first sentence is right here. The second one follows it closely. "
            "And a third sentence ends the paragraph.")  # fmt: skip
    stats = SynthesisStats()
    chunks = list(
        stream_chunks(model, _req(input=text, max_new_tokens=5), stats=stats, decode=False)
    )
    assert stats.sentences == 3
    assert stats.frames == 15  # 5 frames per sentence (EOS never fires in a tiny checkpoint)
    # Chunks keep 4 frames across sentence boundaries; only the last one is short.
    assert [c.frames for c in chunks] == [4, 4, 4, 3]


def test_runaway_generation_ends_at_the_default_cap(model):
    stats = SynthesisStats()
    list(stream_chunks(model, _req(input="Hi."), stats=stats, decode=False))
    assert stats.hit_token_cap and stats.frames == default_max_new_tokens("Hi.")


def test_cancel_stops_within_one_chunk(model):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > 6  # stop after 6 frames were started

    stats = SynthesisStats()
    chunks = list(stream_chunks(model, _req(input="Cancel me soon.", max_new_tokens=40),
                                should_stop=should_stop, stats=stats, decode=False))  # fmt: skip
    assert stats.cancelled
    assert stats.frames == 6
    assert sum(c.frames for c in chunks) <= 6


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"voice": "nobody"}, "unknown voice"), ({"task_type": "base"}, "task_type")],
)
def test_requests_the_model_cannot_serve(model, kw, match):
    with pytest.raises(RequestError, match=match):
        list(stream_chunks(model, _req(input="x", max_new_tokens=2, **kw)))


def test_voice_design_needs_instructions(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("voice_design"))), progress=False)
    with pytest.raises(RequestError, match="instructions"):
        list(stream_chunks(m, SpeechRequest(input="x", max_new_tokens=2)))
    chunks = list(stream_chunks(m, SpeechRequest(input="Designed.", instructions="A deep voice.",
                                                 max_new_tokens=4)))  # fmt: skip
    assert [c.frames for c in chunks] == [4]


def test_base_model_clones_from_reference_audio(tiny_checkpoint, tmp_path: Path):
    import wave

    m, _ = load(resolve(str(tiny_checkpoint("base"))), progress=False)
    ref = tmp_path / "ref.wav"
    with wave.open(str(ref), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        t = np.arange(24000) / 24000
        w.writeframes((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes())
    from mlx_audio.utils import load_audio

    audio = load_audio(str(ref), sample_rate=24000)
    # x-vector prompt (ref_audio alone) and in-context cloning (ref_audio + ref_text)
    for ref_text in (None, "A reference sentence."):
        chunks = list(stream_chunks(m, SpeechRequest(input="Cloned voice.", max_new_tokens=4,
                                                     ref_text=ref_text), ref_audio=audio))  # fmt: skip
        assert [c.frames for c in chunks] == [4]


# -- end of speech: a checkpoint whose utterances end by EOS (eos="text"), as real ones do -------


@pytest.fixture(scope="module")
def eos_model(tiny_checkpoint):
    m, _ = load(resolve(str(tiny_checkpoint("custom_voice", eos="text"))), progress=False)
    return m


def _frames_until_eos(model, text: str, seed: int = 7, **kw) -> SynthesisStats:
    stats = SynthesisStats()
    list(stream_chunks(model, _req(input=text, seed=seed, **kw), stats=stats, decode=False))
    return stats


def test_eos_ends_each_text_at_its_own_frame(eos_model):
    texts = ["Hi.", "How are you today?", "The quick brown fox jumps over the lazy dog."]
    runs = [_frames_until_eos(eos_model, t) for t in texts]
    assert not any(r.hit_token_cap for r in runs)
    frames = [r.frames for r in runs]
    assert frames[0] >= 3 and frames[0] < frames[1] < frames[2], frames  # longer text, later EOS
    assert all(f < default_max_new_tokens(t) / 4 for f, t in zip(frames, texts, strict=True))
    # Same text and seed: the same frame count (deterministic); a cap below it still caps.
    assert _frames_until_eos(eos_model, texts[2]).frames == frames[2]
    capped = _frames_until_eos(eos_model, texts[2], max_new_tokens=frames[2] - 1)
    assert capped.hit_token_cap and capped.frames == frames[2] - 1


def test_eos_stream_has_a_short_last_chunk_and_no_seams(eos_model):
    # A text and seed whose EOS frame is not a multiple of 4 (checked, not assumed).
    text, seed = next((t, s) for t in ("No seams here, please.", "Short and sweet.", "Hello there.")
                      for s in (7, 8, 9)
                      if _frames_until_eos(eos_model, t, s).frames % 4)  # fmt: skip
    stats = SynthesisStats()
    chunks = list(
        stream_chunks(eos_model, _req(input=text, seed=seed), keep_codes=True, stats=stats)
    )
    n = stats.frames
    assert not stats.hit_token_cap and n % 4
    assert [c.frames for c in chunks] == [4] * (n // 4) + [n % 4]
    assert [c.audio.shape[0] for c in chunks] == [c.frames * FRAME_SAMPLES for c in chunks]
    streamed = np.concatenate([c.audio for c in chunks])
    reference = one_shot_decode(eos_model, np.concatenate([c.codes for c in chunks]))
    assert np.abs(reference).max() > 1e-3
    np.testing.assert_allclose(streamed, reference, atol=2e-4, rtol=0)


def test_eos_sentences_each_end_and_chunks_span_the_boundaries(eos_model):
    text = "Good morning to you all. See you again soon."
    stats = SynthesisStats()
    chunks = list(stream_chunks(eos_model, _req(input=text), stats=stats, keep_codes=True))
    assert stats.sentences == 2 and not stats.hit_token_cap
    # Each sentence ended by EOS on its own (the second alone ends at about the same frame).
    first = _frames_until_eos(eos_model, "Good morning to you all.")
    assert first.frames < stats.frames
    assert [c.frames for c in chunks][:-1] == [4] * (len(chunks) - 1)
    assert sum(c.frames for c in chunks) == stats.frames
    streamed = np.concatenate([c.audio for c in chunks])
    reference = one_shot_decode(eos_model, np.concatenate([c.codes for c in chunks]))
    np.testing.assert_allclose(streamed, reference, atol=2e-4, rtol=0)


def test_eos_in_quantized_checkpoints(tiny_checkpoint):
    text = "The quick brown fox jumps over the lazy dog."
    for bits in (8, 4):
        m, _ = load(
            resolve(str(tiny_checkpoint("custom_voice", eos="text", bits=bits))), progress=False
        )
        stats = _frames_until_eos(m, text)
        assert not stats.hit_token_cap and 3 <= stats.frames < default_max_new_tokens(text) / 4
