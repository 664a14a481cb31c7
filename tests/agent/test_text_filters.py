"""The agent's TTS text transforms: LiveKit's markdown filter with the reply's plain start sent
on at once (`filter_markdown_plain_now`): the same text out as LiveKit's filter, for any cut of
the reply into pieces, and the first word passed on before the LLM's next piece is asked for."""

from __future__ import annotations

import random

import pytest
from livekit.agents.voice.transcription.filters import filter_markdown

from voice_agent.harness.openai_stand_in import llm_tokens
from voice_agent.text_filters import TTS_TEXT_TRANSFORMS, filter_markdown_plain_now

TEXTS = [
    "Sure, the capital of France is Paris. Anything else?",
    "Sure **bold** text and _it_ here, a_b and 5 * 3.",
    "Hello - world\n- item\n# Head\n***\nok",
    "Here: [a link](http://x) and ![img](u) done.",
    "  spaced - start",
    "I have `code` and ~~gone~~ here",
    "Word",
    "",
    "   ",
    "Sure\n\n---\nmore > less",
]


async def _out(transform, pieces: list[str]) -> str:
    async def gen():
        for p in pieces:
            yield p

    return "".join([x async for x in transform(gen())])


def _cuts(text: str, rnd: random.Random) -> list[list[str]]:
    inner = range(1, len(text))
    cut = sorted(rnd.sample(inner, min(len(inner), 5))) if len(text) > 1 else []
    return [llm_tokens(text), list(text), [text],
            [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)], strict=True)]]  # fmt: skip


async def test_the_same_text_as_livekits_markdown_filter():
    rnd = random.Random(0)
    alphabet = [*"ab XY,.!?*_-#`~[]()>\n", "**", "Sure", " the", "!["]
    texts = TEXTS + ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 14)))
                     for _ in range(400)]  # fmt: skip
    for text in texts:
        for pieces in _cuts(text, rnd):
            assert await _out(filter_markdown_plain_now, pieces) == await _out(
                filter_markdown, pieces
            ), (text, pieces)


async def test_the_first_word_goes_on_before_the_next_piece_is_asked_for():
    """LiveKit's filter holds "Sure" until the next piece; this one passes it on at once (the
    engine commits a word once it sees what follows it: one LLM token sooner)."""
    asked: list[str] = []
    seen: list[tuple[str, list[str]]] = []

    async def llm():
        for piece in ["Sure", ",", " the", " **capital**", "."]:
            asked.append(piece)
            yield piece

    async for out in filter_markdown_plain_now(llm()):
        seen.append((out, list(asked)))
    assert seen[0] == ("Sure", ["Sure"])
    assert seen[1] == (",", ["Sure", ","])
    assert "".join(o for o, _ in seen) == "Sure, the capital."
    held: list[tuple[str, list[str]]] = []
    asked.clear()
    async for out in filter_markdown(llm()):
        held.append((out, list(asked)))
    assert held[0] == ("Sure", ["Sure", ","])  # LiveKit's own: one piece later


def test_the_agent_uses_it_in_place_of_livekits():
    assert filter_markdown_plain_now in TTS_TEXT_TRANSFORMS
    assert "filter_markdown" not in TTS_TEXT_TRANSFORMS and "filter_emoji" in TTS_TEXT_TRANSFORMS


@pytest.mark.parametrize("text", TEXTS)
def test_llm_tokens_join_to_the_text(text):
    assert "".join(llm_tokens(text)) == text
