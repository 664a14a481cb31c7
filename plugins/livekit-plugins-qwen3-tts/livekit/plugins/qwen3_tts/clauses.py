"""A segment's first clause as a request of its own: a sentence-tokenizer wrapper whose streams
let the engine start on a reply's opening words before its first sentence is complete.

The engine prefills a request's whole text before its first frame, so the first request of a
reply decides when the listener hears anything. `FirstClauseTokenizer` holds a segment's text
until either its first clause is complete (a comma, semicolon, colon or dash after at least
`min_words` words: that clause is emitted at once, alone) or its first sentence ends first (the
held text then goes to the wrapped tokenizer unchanged). Everything after is the wrapped
tokenizer's own output. Each pushed character ends up in exactly one token, in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from livekit.agents import tokenize, utils
from livekit.agents.utils import aio

# Where a clause may end: after , ; : (and any closing quotes or brackets) followed by a space;
# after a spaced hyphen or double hyphen; after an en or em dash. "3,000", "10:30" and
# "well-known" end none. The whitespace (or next character) must have arrived: a streamed "3,"
# may still become "3,000".
_BOUNDARY = re.compile(r"[,;:][\"'”’)\]]*(?=\s)|(?<=\s)--?(?=\s)|[–—]+(?=[^–—-])")


def count_words(text: str) -> int:
    """Words with at least one letter or digit (a lone dash is no word)."""
    return sum(1 for w in text.split() if any(c.isalnum() for c in w))


def _open_quote_or_bracket(text: str) -> bool:
    return (
        text.count('"') % 2 == 1
        or text.count("“") > text.count("”")
        or text.count("(") > text.count(")")
    )


def first_clause_end(text: str, min_words: int) -> int | None:
    """The index just past the first clause boundary of `text` that has at least `min_words`
    words before it and no quotation or parenthesis left open; None if there is none (yet)."""
    for m in _BOUNDARY.finditer(text):
        head = text[: m.end()]
        if count_words(head) >= min_words and not _open_quote_or_bracket(head):
            return m.end()
    return None


@dataclass(frozen=True)
class Cut:
    """How a segment's held head is handed on: `clause` (None: none) is requested on its own;
    `rest` goes to the sentence tokenizer."""

    clause: str | None
    rest: str


def cut_first_clause(
    head: str, min_words: int, sentences: Callable[[str], list[str]], *, final: bool
) -> Cut | None:
    """Decide on the text a segment has received so far; None: wait for more.

    `sentences` is the wrapped tokenizer's `tokenize`: a clause is cut only inside the first
    sentence as it would cut it (short sentences it merges count as one), and the head is handed
    on uncut as soon as that first sentence is over. `final`: no more text will come.
    """
    end = first_clause_end(head, min_words)
    if end is not None:
        if len(sentences(head[:end])) == 1:
            return Cut(head[:end].strip(), head[end:])
        return Cut(None, head)  # the first sentence ended before its first clause
    if final or len(sentences(head)) > 1:
        return Cut(None, head)
    return None


class FirstClauseTokenizer(tokenize.SentenceTokenizer):
    """`tokenizer`, except that each segment's first clause (of >= `min_words` words) comes out
    on its own, as early as it is complete. `min_words` 0 or None: exactly `tokenizer`."""

    def __init__(self, tokenizer: tokenize.SentenceTokenizer, *, min_words: int | None) -> None:
        self._tokenizer = tokenizer
        self._min_words = min_words or 0

    def tokenize(self, text: str, *, language: str | None = None) -> list[str]:
        if not self._min_words:
            return self._tokenizer.tokenize(text, language=language)
        cut = cut_first_clause(text, self._min_words, self._sentences(language), final=True)
        assert cut is not None  # final: always decided
        rest = self._tokenizer.tokenize(cut.rest, language=language) if cut.rest.strip() else []
        return [cut.clause, *rest] if cut.clause else rest

    def stream(self, *, language: str | None = None) -> tokenize.SentenceStream:
        if not self._min_words:
            return self._tokenizer.stream(language=language)
        return FirstClauseStream(self._tokenizer, self._min_words, language)

    def _sentences(self, language: str | None) -> Callable[[str], list[str]]:
        return lambda text: self._tokenizer.tokenize(text, language=language)


class _Segment:
    """One segment (text between flushes): its first clause, then its own wrapped stream."""

    def __init__(self, inner: tokenize.SentenceStream) -> None:
        self.id = utils.shortuuid()
        self.inner = inner
        self.head: aio.Chan[tokenize.TokenData] = aio.Chan()  # the clause; closed at hand-off
        self._head_done = False

    async def next(self) -> tokenize.TokenData | None:
        if not self._head_done:
            try:
                return await self.head.recv()
            except aio.ChanClosed:
                self._head_done = True
        ev = await anext(self.inner, None)
        # One segment id for the clause and the rest: they belong to one segment.
        return None if ev is None else tokenize.TokenData(segment_id=self.id, token=ev.token)


class FirstClauseStream(tokenize.SentenceStream):
    """The stream of `FirstClauseTokenizer`. The wrapped stream sees no text of a segment before
    that segment's first clause is decided, so the clause always comes out first; each segment
    (a `flush()` starts the next) gets a wrapped stream of its own, read in turn."""

    def __init__(
        self, tokenizer: tokenize.SentenceTokenizer, min_words: int, language: str | None
    ) -> None:
        super().__init__()  # its `_event_ch` only tells `closed`: events come from the segments
        self._tokenizer = tokenizer
        self._min_words = min_words
        self._language = language
        self._segments: aio.Chan[_Segment] = aio.Chan()
        self._reading: _Segment | None = None
        self._start_segment()

    def _start_segment(self) -> None:
        self._segment = _Segment(self._tokenizer.stream(language=self._language))
        self._head: str | None = ""  # held until the first clause is decided; None after
        self._segments.send_nowait(self._segment)

    def push_text(self, text: str) -> None:
        self._check_not_closed()
        if self._head is None:
            self._segment.inner.push_text(text)
            return
        self._head += text
        cut = cut_first_clause(self._head, self._min_words, self._sentences, final=False)
        if cut is not None:
            self._hand_off(cut)

    def _sentences(self, text: str) -> list[str]:
        return self._tokenizer.tokenize(text, language=self._language)

    def _hand_off(self, cut: Cut) -> None:
        if cut.clause:
            self._segment.head.send_nowait(
                tokenize.TokenData(segment_id=self._segment.id, token=cut.clause)
            )
        self._segment.head.close()
        self._head = None
        if cut.rest:
            self._segment.inner.push_text(cut.rest)

    def _end_segment(self) -> None:
        if self._head is not None:
            self._hand_off(cut_first_clause(self._head, self._min_words, self._sentences,
                                            final=True))  # fmt: skip
        self._segment.inner.end_input()

    def flush(self) -> None:
        self._check_not_closed()
        self._end_segment()
        self._start_segment()

    def end_input(self) -> None:
        self._check_not_closed()
        self._end_segment()
        self._segments.close()
        self._do_close()

    async def aclose(self) -> None:
        self._do_close()
        self._segments.close()
        self._segment.head.close()
        await self._segment.inner.aclose()
        if self._reading is not None and self._reading is not self._segment:
            self._reading.head.close()
            await self._reading.inner.aclose()

    async def __anext__(self) -> tokenize.TokenData:
        while True:
            if self._reading is None:
                self._reading = await self._segments.__anext__()  # StopAsyncIteration at the end
            ev = await self._reading.next()
            if ev is not None:
                return ev
            self._reading = None
