"""Incremental tokenization of text that arrives in pieces: the ids fed equal the final text's.

The real tokenizer of the tiny checkpoint (Qwen2's byte-level BPE, its split regex, NFC and the
added tokens), random texts from many scripts and random splits (inside words, inside
combining sequences, inside added tokens). The forced commit points (text with no safe boundary
for `HELD_MAX` characters) also on a BPE trained here with multi-character CJK merges, where a
cut inside a run of letters could change the ids.
"""

import random
import unicodedata

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qwen3_tts_engine.tiny_checkpoints.builder import _QWEN2_PRETOKENIZE_REGEX
from qwen3_tts_engine.worker.incremental_text import (
    HELD_MAX,
    IncrementalText,
    chat_text,
    text_token_ids,
)

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


# -- forced commit points: the work per piece is bounded -------------------------------------------

# characters of earlier pieces the tokenizer may re-read for one piece: the held text (pre-tokenized
# for a natural boundary) and one forced window, each at most HELD_MAX + the margin
REREAD_BOUND = 2 * (HELD_MAX + 32)


def _cjk(rng: random.Random, n: int, alphabet: str | None = None) -> str:
    if alphabet is not None:
        return "".join(rng.choice(alphabet) for _ in range(n))
    return "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(n))


def _one_at_a_time(tokenizer, text: str) -> IncrementalText:
    inc = IncrementalText(tokenizer)
    for c in text:
        inc.append(c)
        assert len(inc.held) <= HELD_MAX
    inc.end()
    return inc


def test_ten_thousand_one_character_cjk_appends_hold_and_reread_a_bounded_text(tokenizer):
    text = _cjk(random.Random(7), 10_000)
    inc = _one_at_a_time(tokenizer, text)
    assert inc.forced >= 10_000 // HELD_MAX  # no natural boundary: every commit was forced
    assert inc.reread_max <= REREAD_BOUND  # a count, not a time: independent of the 10,000
    assert inc.ids == text_token_ids(tokenizer, text)


@pytest.mark.parametrize(
    "unit",
    ["a", "ab ", " ", "!", "e\u0301", "\u0301", "1", "안", "🙂", "<thi"],
    ids=["letters", "words", "spaces", "punctuation", "combining", "marks", "digits", "hangul",
         "emoji", "added-prefix"],
)  # fmt: skip
def test_every_script_holds_a_bounded_tail(tokenizer, unit):
    """Runs that never give a safe boundary (one long word, whitespace, combining marks...) are
    cut too; the ids equal the whole text's with this tokenizer."""
    text = unit * (3000 // len(unit))
    inc = _one_at_a_time(tokenizer, text)
    assert inc.reread_max <= REREAD_BOUND
    assert inc.ids == text_token_ids(tokenizer, text)


def test_one_long_piece_is_walked_through_once(tokenizer):
    """A 50,000-character piece with no boundary: forced cuts walk it window by window (never
    re-reading the rest), leaving at most HELD_MAX held."""
    text = _cjk(random.Random(8), 50_000)
    inc = IncrementalText(tokenizer)
    inc.append(text)
    assert len(inc.held) <= HELD_MAX
    assert inc.reread_max <= REREAD_BOUND
    inc.end()
    assert inc.ids == text_token_ids(tokenizer, text)


_ALPHABET = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"


@pytest.fixture(scope="module")
def cjk_merges():
    """A byte-level BPE with Qwen2's split regex trained on CJK text of a small alphabet, so that
    it merges characters into tokens of up to four (the tiny checkpoint's has no CJK merges)."""
    rng = random.Random(5)
    corpus = [_cjk(rng, 300, _ALPHABET[: rng.randint(3, len(_ALPHABET))]) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([*corpus, *["assistant\nuser\n"] * 50], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return fast


def test_forced_commits_give_the_whole_texts_ids_where_characters_merge(cjk_merges):
    rng = random.Random(11)
    enc = cjk_merges.backend_tokenizer.encode(_cjk(rng, 3000, _ALPHABET), add_special_tokens=False)
    assert max(end - start for start, end in enc.offsets) >= 3  # it does merge characters
    for _ in range(12):
        text = _cjk(rng, 1500, _ALPHABET[: rng.randint(3, len(_ALPHABET))])
        inc = _one_at_a_time(cjk_merges, text)
        assert inc.forced >= 1500 // HELD_MAX
        assert inc.ids == text_token_ids(cjk_merges, text)
        # and the same in random pieces
        fed, _ = _feed(cjk_merges, text, rng, 9)
        assert fed == text_token_ids(cjk_merges, text)
