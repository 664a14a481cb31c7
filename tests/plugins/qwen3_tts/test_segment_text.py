"""A reply segment's text as it arrives (`segment_text.py`), and the options that choose how a
stream's text reaches the engine (`text_input`)."""

from __future__ import annotations

import asyncio

import pytest
from livekit.agents import tokenize
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.segment_text import SegmentText, first_sentence_end, split_sentences

HANG_GUARD = 30.0


async def _collect(text: SegmentText, start: int = 0) -> list[list[str]]:
    return [batch async for batch in text.read(start)]


async def test_a_reader_gets_what_is_there_at_once_then_each_piece_then_the_end():
    text = SegmentText()
    text.append("Hel")
    text.append("lo ")
    reader = text.read()
    assert await anext(reader) == ["Hel", "lo "]  # everything so far, in one batch
    nxt = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)
    assert not nxt.done()  # waits for text
    text.append("world")
    assert await asyncio.wait_for(nxt, HANG_GUARD) == ["world"]
    end = asyncio.ensure_future(anext(reader, None))
    text.end()
    assert await asyncio.wait_for(end, HANG_GUARD) is None
    assert text.text == "Hello world"


async def test_readers_replay_from_any_piece_and_do_not_disturb_each_other():
    text = SegmentText()
    first = asyncio.ensure_future(_collect(text))
    text.append("a ")
    text.append("b ")
    await asyncio.sleep(0)
    late = asyncio.ensure_future(_collect(text, start=1))  # a failover replays from the start
    text.append("c")
    text.end()
    got_first, got_late = await asyncio.wait_for(asyncio.gather(first, late), HANG_GUARD)
    assert "".join(sum(got_first, [])) == "a b c"
    assert "".join(sum(got_late, [])) == "b c"
    assert await _collect(text) == [["a ", "b ", "c"]]  # after the end: all of it at once


SENTENCES = tokenize.basic.SentenceTokenizer().tokenize  # the plugin's default tokenizer


def test_a_sentence_ends_once_the_next_has_begun():
    assert first_sentence_end("How are you doing today?", SENTENCES) is None
    assert first_sentence_end("How are you doing today? ", SENTENCES) is None
    text = "How are you doing today?  I"
    assert text[: first_sentence_end(text, SENTENCES)] == "How are you doing today?"
    # the tokenizer's rules: short sentences join the next; "Mr." ends none
    text = "Hi. Mr. Smith is doing well today. Yes"
    assert text[: first_sentence_end(text, SENTENCES)] == "Hi. Mr. Smith is doing well today."
    # whitespace the tokenizer changes (a newline) does not move the end
    text = "The first line\nruns on to here. And"
    assert text[: first_sentence_end(text, SENTENCES)] == "The first line\nruns on to here."


async def test_streamed_text_is_split_into_one_text_per_sentence_as_it_comes():
    """Each sentence's text is handed on at its first piece and fed as the rest comes (a socket
    streams it at once); a piece that holds a boundary is cut there; all text is kept, in order."""
    text = SegmentText()
    out: list[SegmentText] = []
    splitter = asyncio.create_task(split_sentences(text, SENTENCES, out.append))

    async def split_into(*texts: str) -> None:
        async with asyncio.timeout(HANG_GUARD):
            while [t.text for t in out] != list(texts):
                await asyncio.sleep(0)

    try:
        text.append("How are you ")
        await split_into("How are you ")  # at once, before its sentence is complete
        assert not out[0].ended
        text.append("doing today? I am")
        await split_into("How are you doing today?", " I am")
        assert out[0].ended and not out[1].ended
        text.append(" fine, thanks for asking. Bye now. And")  # two boundaries in one piece
        text.append(" you?")
        text.end()
        await asyncio.wait_for(splitter, HANG_GUARD)
    finally:
        splitter.cancel()
        await asyncio.gather(splitter, return_exceptions=True)
    assert [t.text for t in out] == ["How are you doing today?", " I am fine, thanks for asking.",
                                     " Bye now. And you?"]  # fmt: skip
    assert all(t.ended for t in out)


async def test_a_cancelled_reader_leaves_the_text_usable():
    text = SegmentText()
    waiting = asyncio.ensure_future(_collect(text))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    text.append("still here")  # would raise if the cancel had cancelled the shared future
    text.end()
    assert await _collect(text) == [["still here"]]


async def test_has_words_waits_past_whitespace_and_appends_after_the_end_are_refused():
    text = SegmentText()
    words = asyncio.ensure_future(text.has_words())
    text.append(" ")
    text.append("\n")
    await asyncio.sleep(0)
    assert not words.done()
    text.append("Hi")
    assert await asyncio.wait_for(words, HANG_GUARD) is True
    blank = SegmentText()
    blank.append("  ")
    blank.end()
    assert await blank.has_words() is False
    with pytest.raises(RuntimeError):
        blank.append("late")


async def test_text_input_is_checked_like_the_other_options():
    tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9")
    try:
        assert tts._opts.text_input == "auto" and tts._opts.streams_text() is None
        tts.update_options(text_input="sentences")
        assert tts._opts.streams_text() is False
        tts.update_options(text_input="stream")
        assert tts._opts.streams_text() is True
        with pytest.raises(ValueError, match="text_input"):
            tts.update_options(text_input="words")
        assert tts._opts.text_input == "stream"  # a refused change changes nothing
    finally:
        await tts.aclose()
    # vLLM-Omni streams too (its socket dialect): "auto" tries its upgrade (a 404: sentences)
    omni = qwen3_tts.TTS(base_url="http://127.0.0.1:9", protocol="vllm-omni", text_input="stream")
    assert omni._opts.streams_text() is True
    await omni.aclose()
    omni = qwen3_tts.TTS(base_url="http://127.0.0.1:9", protocol="vllm-omni")
    assert omni._opts.streams_text() is None
    await omni.aclose()


async def test_the_start_message_carries_the_request_fields_and_the_reply_first_chunk():
    tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9", voice="ryan", language="en", seed=5,
                        first_chunk_frames=4, first_clause_chunk_frames=2, max_new_tokens=30)  # fmt: skip
    try:
        start = tts._opts.stream_start(seed=5)
    finally:
        await tts.aclose()
    assert start == {"type": "session.start", "model": "qwen3-tts", "voice": "ryan",
                     "response_format": "pcm", "language": "English", "max_new_tokens": 30,
                     "seed": 5, "first_chunk_frames": 2}  # fmt: skip
