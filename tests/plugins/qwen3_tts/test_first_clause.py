"""The Qwen3-TTS plugin's first clause: a segment's first request carries only its opening clause
(once it has `first_clause_min_words` words) with a small first chunk, the rest follows as whole
sentences; nothing dropped, duplicated or reordered. The splitter on its own (text pushed in
small pieces), then the plugin against a real engine on a tiny checkpoint (127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest
from aiohttp import web
from livekit.agents import tokenize
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.clauses import FirstClauseTokenizer, cut_first_clause
from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES
from tests.support.engine_process import free_port
from tests.support.tts_audio import pcm, synthesize

pytestmark = pytest.mark.usefixtures(
    "fail_on_leaked_tasks"
)  # no task of the plugin outlives a test

WAIT = 60.0  # a bound on any one wait: a failure, never a timing claim
EXAMPLE = "Well, let me check that for you, it will take a moment. Done."
TEXTS = [
    EXAMPLE,
    "Sure, I can book a table for four people on Friday evening. Anything else?",
    "Sure, I can book a table. Anything else?",
    "Hi. Yes, of course I can help you with that: just tell me the date. Then we are set.",
    "It costs 3,000 dollars at 10:30 — a well-known price; you can pay later.",
    "The meeting - as I said before - starts soon, right after lunch.",
    'He said, "Yes, we can do it," and then he left, smiling at everyone in the room.',
    "One two three four five six seven eight nine ten eleven twelve.",
    "No punctuation at all in this one",
    "Dr. Smith said, as usual, that it was fine. Mr. Jones agreed; so did I.",
    "First line here,\nsecond line there, and more text. Next sentence follows here.",
    "A short one, then more words follow here; and more. Another sentence again.",
    "Hmm — okay.",
    "",
]


def _basic() -> tokenize.SentenceTokenizer:
    return tokenize.basic.SentenceTokenizer()


def _pieces(text: str, rng: random.Random, most: int = 6) -> list[str]:
    """`text` in small pieces, as an LLM streams tokens (a boundary mark and the space after it
    often arrive in different pieces)."""
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i : i + n])
        i += n
    return out


async def _stream(tokenizer, pieces: list[str], flush_after: set[int] = frozenset()) -> list:
    """Push `pieces` into `tokenizer.stream()`, yielding to the loop after each; its TokenData."""
    stream = tokenizer.stream()
    events: list[tokenize.TokenData] = []

    async def read():
        async for ev in stream:
            events.append(ev)

    reader = asyncio.create_task(read())
    for i, piece in enumerate(pieces):
        stream.push_text(piece)
        if i in flush_after:
            stream.flush()
        await asyncio.sleep(0)
    stream.end_input()
    await asyncio.wait_for(reader, WAIT)
    await stream.aclose()
    return events


def _squash(text: str) -> str:
    return "".join(text.split())


# -- the splitter --------------------------------------------------------------------------


@pytest.mark.parametrize("most", [1, 3, 7, 1000])
async def test_example_streamed_in_pieces_cuts_the_first_clause(most):
    rng = random.Random(most)
    events = await _stream(FirstClauseTokenizer(_basic(), min_words=3), _pieces(EXAMPLE, rng, most))
    assert [e.token for e in events] == ["Well, let me check that for you,",
                                         "it will take a moment.", "Done."]  # fmt: skip
    assert len({e.segment_id for e in events}) == 1  # one segment: the clause belongs to it


async def test_the_clause_is_out_before_its_sentence_ends():
    """The point of it all: the clause comes out as soon as the space after its comma arrives,
    while the sentence is still being written (input not ended)."""
    stream = FirstClauseTokenizer(_basic(), min_words=3).stream()
    try:
        stream.push_text("Well, let me check that for you,")
        stream.push_text(" it will")
        first = await asyncio.wait_for(anext(stream), WAIT)
        assert first.token == "Well, let me check that for you,"
        stream.push_text(" take a moment. Done.")
        stream.end_input()
        assert [e.token async for e in stream] == ["it will take a moment.", "Done."]
    finally:
        await stream.aclose()


@pytest.mark.parametrize("text", ["Sure, I can book a table for four people on Friday evening. "
                                  "Anything else?",
                                  "The first sentence is here. Then, much later, a clause."])  # fmt: skip
async def test_no_boundary_with_enough_words_in_the_first_sentence_sends_it_whole(text):
    """ "Sure," is too short (3 words needed) and nothing else cuts the first sentence; a clause of
    a later sentence is never cut (only a segment's first request is a clause)."""
    events = await _stream(
        FirstClauseTokenizer(_basic(), min_words=3), _pieces(text, random.Random(1))
    )
    today = await _stream(_basic(), _pieces(text, random.Random(1)))
    assert [e.token for e in events] == [e.token for e in today] == _basic().tokenize(text)


@pytest.mark.parametrize("min_words", [0, None])
async def test_off_is_exactly_todays_sentences(min_words):
    wrapper = FirstClauseTokenizer(_basic(), min_words=min_words)
    assert isinstance(wrapper.stream(), type(_basic().stream()))
    for i, text in enumerate(TEXTS):
        got = await _stream(wrapper, _pieces(text, random.Random(i)))
        today = await _stream(_basic(), _pieces(text, random.Random(i)))
        assert [e.token for e in got] == [e.token for e in today], text
        assert wrapper.tokenize(text) == _basic().tokenize(text)


@pytest.mark.parametrize("min_words", [1, 2, 3, 5, 8])
async def test_every_character_once_and_in_order(min_words):
    """For every text and piece size: the tokens concatenate to the input (modulo whitespace),
    the first token is a prefix of what today's first sentence would be, and streaming agrees
    with `tokenize()` on the whole text."""
    wrapper = FirstClauseTokenizer(_basic(), min_words=min_words)
    for i, text in enumerate(TEXTS):
        for most in (1, 4, 9):
            got = [e.token for e in await _stream(wrapper, _pieces(text, random.Random(i), most))]
            assert _squash("".join(got)) == _squash(text), (text, got)
            assert got == wrapper.tokenize(text), (text, most, got)
            if got:
                assert _squash(_basic().tokenize(text)[0]).startswith(_squash(got[0])), got


async def test_each_segment_gets_its_own_first_clause_in_order():
    """`flush()` ends a segment: the next one starts with its own clause, after everything of
    the previous one, with a segment id of its own."""
    first, second = EXAMPLE, "Right, so the table is booked for you, see you on Friday."
    pieces = _pieces(first, random.Random(3)) + _pieces(second, random.Random(4))
    events = await _stream(FirstClauseTokenizer(_basic(), min_words=3), pieces,
                           flush_after={len(_pieces(first, random.Random(3))) - 1})  # fmt: skip
    assert [e.token for e in events] == [
        "Well, let me check that for you,", "it will take a moment.", "Done.",
        "Right, so the table is booked for you,", "see you on Friday.",
    ]  # fmt: skip
    ids = [e.segment_id for e in events]
    assert ids[0] == ids[1] == ids[2] != ids[3] == ids[4]


def test_cut_decisions():
    sentences = _basic().tokenize
    assert cut_first_clause("Well, let me check that for you,", 3, sentences, final=False) is None
    cut = cut_first_clause("Well, let me check that for you, it", 3, sentences, final=False)
    assert (cut.clause, cut.rest) == ("Well, let me check that for you,", " it")
    for text in ("It costs 3,000 dollars", "We meet at 10:30 sharp", "A well-known and fine place"):
        assert cut_first_clause(text + " and", 2, sentences, final=False) is None, text
    cut = cut_first_clause("I think — really — that it", 2, sentences, final=False)
    assert cut.clause == "I think —"
    # no cut inside a quotation or parenthesis
    cut = cut_first_clause('He said, "Yes, we can do it," and he', 3, sentences, final=False)
    assert cut.clause == 'He said, "Yes, we can do it,"'
    cut = cut_first_clause("The table (for four, on Friday) is booked, and", 3, sentences,
                           final=False)  # fmt: skip
    assert cut.clause == "The table (for four, on Friday) is booked,"
    # the first sentence is over before any clause: handed on whole, not cut later
    cut = cut_first_clause(
        "The first sentence is here. Then, much later", 3, sentences, final=False
    )
    assert (cut.clause, cut.rest) == (None, "The first sentence is here. Then, much later")
    assert cut_first_clause("Short, one", 3, sentences, final=True) == type(cut)(None, "Short, one")


# -- options -------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {"first_clause_min_words": -1}, {"first_clause_min_words": 2.5},
    {"first_clause_min_words": True}, {"first_clause_min_words": "3"},
    {"first_clause_chunk_frames": 3}, {"first_clause_chunk_frames": 0},
    {"first_clause_chunk_frames": "2"},
])  # fmt: skip
async def test_options_are_checked(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        qwen3_tts.TTS(base_url="http://127.0.0.1:9", **kw)
    tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9")
    try:
        with pytest.raises(ValueError, match=name):
            tts.update_options(**kw)
        assert tts._opts.first_clause_min_words == 3  # a refused update changes nothing
    finally:
        await tts.aclose()


async def test_first_request_options():
    tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9")
    try:
        opts = tts._opts
        # by default a reply's first request asks for a 2-frame first chunk (bench first-chunk)
        assert (opts.first_clause_min_words, opts.first_clause_chunk_frames) == (3, 2)
        assert [opts.for_request(i).first_chunk_frames for i in range(3)] == [2, 4, 4]
        assert opts.stream_start(1)["first_chunk_frames"] == 2
        tts.update_options(first_clause_chunk_frames=None)
        assert [tts._opts.for_request(i).first_chunk_frames for i in range(3)] == [4, 4, 4]
        assert tts._opts.stream_start(1)["first_chunk_frames"] == 4
        tts.update_options(first_clause_chunk_frames=2)
        opts = tts._opts
        assert [opts.for_request(i).first_chunk_frames for i in range(3)] == [2, 4, 4]
        assert opts.for_request(0).request_body("x", 1)["first_chunk_frames"] == 2
        tts.update_options(first_chunk_frames=1)  # the first chunk never grows
        assert tts._opts.for_request(0).first_chunk_frames == 1
        tts.update_options(first_chunk_frames=4, first_clause_chunk_frames=1)
        assert [tts._opts.for_request(i).first_chunk_frames for i in range(2)] == [1, 4]
        for off in (0, None):
            tts.update_options(first_clause_min_words=off)
            assert tts._opts.for_request(0).first_chunk_frames == 4
    finally:
        await tts.aclose()


async def test_off_sends_todays_requests():
    """With the split off, a loopback server that speaks the protocol gets exactly today's
    requests: whole sentences, each with the configured first chunk."""
    seen: list[dict] = []

    async def speech(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await resp.prepare(request)
        await resp.write(b"\x01\x00" * FRAME_SAMPLES)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    results = {}
    try:
        for off in (0, 3):
            seen.clear()
            tts = qwen3_tts.TTS(base_url=f"http://127.0.0.1:{port}", voice="ryan", seed=1,
                                first_clause_min_words=off, first_clause_chunk_frames=2)  # fmt: skip
            try:
                _, audio, _ = await _speak(tts, _pieces(EXAMPLE, random.Random(5), 3))
            finally:
                await tts.aclose()
            assert len(audio) == len(seen) * FRAME_SAMPLES
            results[off] = [(b["input"], b["first_chunk_frames"]) for b in seen]
    finally:
        await runner.cleanup()
    assert results[0] == [("Well, let me check that for you, it will take a moment.", 4),
                          ("Done.", 4)]  # fmt: skip
    assert results[3] == [("Well, let me check that for you,", 2),
                          ("it will take a moment.", 4), ("Done.", 4)]  # fmt: skip


# -- against a real engine -------------------------------------------------------------------


async def _speak(tts, pieces: list[str], *, before_each=None):
    """Push `pieces` into `tts.stream()` (awaiting `before_each(i)` first, if given); returns
    (stream, int16 audio, audio events)."""
    stream = tts.stream()
    audio, events = [], []

    async def feed():
        for i, piece in enumerate(pieces):
            if before_each is not None:
                await before_each(i)
            stream.push_text(piece)
            await asyncio.sleep(0)
        stream.end_input()

    feeder = asyncio.create_task(feed())
    try:
        async for ev in stream:
            events.append(ev)
            if (data := pcm(ev)) is not None:
                audio.append(data)
        await feeder
    finally:
        await stream.aclose()
        feeder.cancel()
    return stream, np.concatenate(audio) if audio else np.zeros(0, np.int16), events


@pytest.mark.slow
async def test_first_request_to_a_real_engine_is_the_first_clause(engine):
    """A long first sentence streamed in small pieces: the engine's first request is only its
    first clause with first_chunk_frames 2, sent before the sentence is complete; then the rest
    of it and the next sentence with the default 4. The audio is exactly what the engine made
    for those requests, in text order, and one LiveKit segment."""
    url = f"http://127.0.0.1:{engine.port}"
    handler = engine.engine.active
    text = ("Well, let me check that for you, it will take just a moment to look. "
            "The table is booked for Friday.")  # fmt: skip
    expected = ["Well, let me check that for you,", "it will take just a moment to look.",
                "The table is booked for Friday."]  # fmt: skip
    pieces = _pieces(text, random.Random(7), 4)
    sent: list[dict] = []
    first_sent = asyncio.Event()

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/audio/speech":
            sent.append(json.loads(request.content))
            first_sent.set()

    # The feeder holds back the end of the first sentence until the first request is out: a
    # plugin that waited for the whole sentence would never send it (WAIT fails the test).
    clause_done = text.index("you, ") + len("you, ")  # the space after the comma is needed
    held_at = next(i for i in range(len(pieces)) if len("".join(pieces[:i])) >= clause_done)
    assert "moment" not in "".join(pieces[:held_at])

    async def before_each(i: int) -> None:
        if i == held_at:
            await asyncio.wait_for(first_sent.wait(), WAIT)

    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), event_hooks={"request": [record]})
    # 8 frames a request (2 + 4 + 2 for the first): the order and the chunking are what is
    # tested, not long audio
    tts = qwen3_tts.TTS(base_url=url, voice="ryan", language="en", seed=11, http_client=client,
                        first_clause_min_words=3, first_clause_chunk_frames=2, max_new_tokens=8,
                        text_input="sentences")  # fmt: skip
    before = len(handler.history)
    try:
        stream, audio, events = await asyncio.wait_for(
            _speak(tts, pieces, before_each=before_each), 300
        )
    finally:
        await tts.aclose()
    assert [b["input"] for b in sent] == expected
    assert [b["first_chunk_frames"] for b in sent] == [2, 4, 4]
    assert len({b["seed"] for b in sent}) == 1  # the configured seed, on every request
    reports = stream.sentences
    assert [r.text for r in reports] == expected
    assert [r.first_chunk_frames for r in reports] == [2, 4, 4]

    # What the engine synthesized: one utterance per request, in order, each ended by EOS or
    # its 8-frame cap, with the first chunk asked for (2 frames, then 4).
    made = list(handler.history)[before:]
    assert len(made) == 3 and not any(s["cancelled"] for s in made), made
    assert [s["chunk_frames"][0] for s in made] == [
        min(2, made[0]["frames"]),
        *(min(4, s["frames"]) for s in made[1:]),
    ]
    assert [r.samples for r in reports] == [s["frames"] * FRAME_SAMPLES for s in made]
    assert len(audio) == sum(s["frames"] for s in made) * FRAME_SAMPLES

    # Text order is audio order: the stream equals each request synthesized on its own.
    reference = []
    for body in sent:
        one = qwen3_tts.TTS(base_url=url, voice="ryan", language="en", seed=body["seed"],
                            first_chunk_frames=body["first_chunk_frames"], max_new_tokens=8)  # fmt: skip
        try:
            reference.append(await synthesize(one, body["input"]))
        finally:
            await one.aclose()
    reference = np.concatenate(reference)
    assert audio.shape == reference.shape
    np.testing.assert_array_equal(audio, reference)

    # LiveKit's transcript sync pairs the text of a flushed segment with the audio of one
    # emitter segment: the clause did not open a segment of its own.
    assert len({ev.segment_id for ev in events}) == 1
    assert [ev.is_final for ev in events].count(True) == 1 and events[-1].is_final


async def test_update_options_is_typed_and_normalizes():
    """LiveKit's style: keyword options, NOT_GIVEN leaves an option alone, a language code is
    normalized as in the constructor, and an option the plugin does not have is a TypeError."""
    tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9", voice="ryan", seed=7)
    try:
        tts.update_options(voice="aiden", language="en-GB", variant="4bit")
        opts = tts._opts
        assert (opts.voice, opts.language, opts.variant, opts.seed) == (
            "aiden",
            "english",
            "4bit",
            7,
        )
        tts.update_options(voice=None)  # None is a value (the model's first voice), not "unchanged"
        assert tts._opts.voice is None and tts._opts.language == "english"
        with pytest.raises(ValueError, match="language"):
            tts.update_options(language="klingon")
        with pytest.raises(TypeError):
            tts.update_options(speed=1.2)
        assert tts._opts.language == "english"
    finally:
        await tts.aclose()
