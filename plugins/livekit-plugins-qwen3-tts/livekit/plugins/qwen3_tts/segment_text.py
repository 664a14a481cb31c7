"""The text of one reply segment as the LLM writes it, kept whole so that it can be read again
from the start: by the sentence splitter, or by a socket that replays it after a failover.
`split_sentences` streams it on as one text per sentence (a socket's utterances under a cap)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from .protocol import has_speakable_text


class SegmentText:
    """Pieces of text in arrival order, then an end. Any number of readers, each from any index."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.ended = False
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def append(self, piece: str) -> None:
        if self.ended:
            raise RuntimeError("text appended to a segment that has ended")
        self.pieces.append(piece)
        self._wake()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._wake()

    def _wake(self) -> None:
        self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    async def has_words(self) -> bool:
        """Wait until the text holds something to say (True) or ends without (False)."""
        async for _ in self.read():
            if has_speakable_text(self.text):
                return True
        return False

    async def read(self, start: int = 0) -> AsyncIterator[list[str]]:
        """Everything from piece `start` on, in batches: all pieces that are there, then each
        later batch as it comes; returns at the end."""
        i = start
        while True:
            changed = self._changed
            if i < len(self.pieces):
                batch, i = self.pieces[i:], len(self.pieces)
                yield batch
                continue
            if self.ended:
                return
            await asyncio.shield(changed)


def first_sentence_end(text: str, tokenize: Callable[[str], list[str]]) -> int | None:
    """The index just past the first sentence of `text` by `tokenize` (a sentence tokenizer's
    `tokenize`), once a later sentence has begun; None while `text` holds one sentence at most.
    Tokenizers may change whitespace, not other characters: the sentence ends after as many
    characters that are not whitespace as it has."""
    sentences = tokenize(text)
    if len(sentences) < 2:
        return None
    left = sum(not c.isspace() for c in sentences[0])
    for i, c in enumerate(text):
        if not c.isspace():
            left -= 1
            if left == 0:
                return i + 1
    return None


async def split_sentences(text: SegmentText, tokenize: Callable[[str], list[str]],
                          out: Callable[[SegmentText], None]) -> None:  # fmt: skip
    """Copy `text` into one SegmentText per sentence (by `tokenize`), each handed to `out` as its
    first piece comes and fed as the rest does: its text goes on while the next is not known.
    A sentence ends once the next has begun; text already passed on stays where it went (a
    boundary that later text moves back is taken at the piece that revealed it)."""
    current: SegmentText | None = None
    async for batch in text.read():
        piece = "".join(batch)
        while piece:
            if current is None:
                current = SegmentText()
                out(current)
            end = first_sentence_end(current.text + piece, tokenize)
            if end is None:
                current.append(piece)
                break
            cut = max(0, end - len(current.text))
            if cut:
                current.append(piece[:cut])
            current.end()
            current, piece = None, piece[cut:]
    if current is not None:
        current.end()
