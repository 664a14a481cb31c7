"""Incremental tokenization of text that arrives in pieces: the ids fed equal the final text's.

The real tokenizer of the tiny checkpoint (Qwen2's byte-level BPE, its split regex, NFC and the
added tokens), random texts from many scripts and random splits (inside words, inside
combining sequences, inside added tokens).
"""

import random
import unicodedata

import pytest
from transformers import AutoTokenizer

from qwen3_tts_engine.worker.incremental_text import IncrementalText, chat_text, text_token_ids

PIECES = [
    "Hello",
    " there",
    ",",
    " how",
    " are",
    " you",
    "?",
    " I'll",
    " won't",
    " it's",
    " 10:45pm",
    " 3.14159",
    " -0.5e10",
    " 1,000,000",
    " naïve",
    " café",
    " e\u0301",
    " co\u0308operate",
    " x\u0301\u0323",
    " ==\u0338",
    " \u1100\u1161\u11a8",
    " 你好",
    "，",
    "世界",
    "！",
    "今天天气很好",
    "。",
    " こんにちは",
    " 안녕하세요",
    " Привет",
    " مرحبا",
    " 🙂",
    " 👍🏽",
    "\n",
    "\n\n",
    "  ",
    "\t",
    " \n ",
    "...",
    "!!",
    " (",
    ")",
    ' "quoted"',
    " <",
    "think",
    ">",
    " <think>",
    "</think>",
    " <|im_end|>",
    " <tts_pad>",
    "—",
    " –",
    " ‘single’",
    " «guillemets»",
    "\u200b",
    " \u00a0",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("custom_voice")))


def _random_text(rng: random.Random) -> str:
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))
    return text if rng.random() < 0.8 else rng.choice(["", " ", "\n"]) + text


def _feed(
    tokenizer, text: str, rng: random.Random, max_piece: int
) -> tuple[list[int], IncrementalText]:
    inc = IncrementalText(tokenizer)
    fed: list[int] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, max_piece)
        fed += inc.append(text[i : i + n])
        assert fed == inc.ids
        i += n
    fed += inc.end()
    return fed, inc


def test_ids_fed_equal_the_final_texts_ids_for_any_split(tokenizer):
    rng = random.Random(36)
    checked = 0
    for _ in range(400):
        text = _random_text(rng)
        final = text_token_ids(tokenizer, unicodedata.normalize("NFC", text))
        assert final == text_token_ids(tokenizer, text)  # the tokenizer normalizes (NFC) itself
        for max_piece in (1, 3, 7, 40):
            fed, inc = _feed(tokenizer, text, rng, max_piece)
            assert fed == final, (text, max_piece)
            assert inc.head_ids == list(tokenizer.encode(chat_text(text)))[:3]
            assert inc.chars == len(text)
            checked += 1
    assert checked == 1600


def test_every_character_split_of_tricky_texts(tokenizer):
    """Each text cut at every single position (two pieces), and fed one character at a time."""
    texts = ["a\n \nb  c", "e\u0301\u0323 x", "a <think> b <thi", "你好，世界", "I'll go.\n\n  Ok",
             "\nstart", "  two", "12ab34", "\u1100\u1161 \u11a8"]  # fmt: skip
    for text in texts:
        final = text_token_ids(tokenizer, text)
        for cut in range(len(text) + 1):
            inc = IncrementalText(tokenizer)
            fed = inc.append(text[:cut]) + inc.append(text[cut:]) + inc.end()
            assert fed == final, (text, cut)
        inc = IncrementalText(tokenizer)
        assert [i for c in text for i in inc.append(c)] + inc.end() == final


def test_words_are_committed_before_the_end_and_the_partial_word_is_held(tokenizer):
    inc = IncrementalText(tokenizer)
    assert inc.append("Hello wor") == text_token_ids(tokenizer, "Hello")
    assert inc.held == " wor"
    inc.append("ld, how")
    assert inc.ids == text_token_ids(tokenizer, "Hello world,")
    assert inc.held == " how"
    assert inc.append(" are you") and inc.held == " you"
    inc.end()
    assert inc.ids == text_token_ids(tokenizer, "Hello world, how are you")
    assert inc.ended and inc.held == ""
    with pytest.raises(ValueError):
        inc.append("more")


def test_trailing_whitespace_and_a_leading_newline_are_held(tokenizer):
    inc = IncrementalText(tokenizer)
    assert inc.append("\n") == []  # it may merge with the template's own newline
    inc.append("Hi \n ")
    assert inc.ids == text_token_ids(tokenizer, "\nHi")[: len(inc.ids)] and inc.held.endswith("\n ")
    inc.end()
    assert inc.ids == text_token_ids(tokenizer, "\nHi \n ")
