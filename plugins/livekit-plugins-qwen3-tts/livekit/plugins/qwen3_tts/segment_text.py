"""The text of one reply segment as the LLM writes it, kept whole so that it can be read again
from the start: by the sentence splitter, or by a socket that replays it after a failover."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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
