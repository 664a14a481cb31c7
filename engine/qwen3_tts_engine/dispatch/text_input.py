"""The text of one streamed-text utterance, as it arrives from the client.

The route appends pieces and ends it; the handler that serves the utterance attaches its worker
pipe and gets everything so far, then each piece as it comes. A request moved to another handler
before it started (a swap) attaches there instead: nothing is lost, since the pieces are kept.
"""

from __future__ import annotations

from collections.abc import Callable


class TextInput:
    def __init__(self, initial: str = "") -> None:
        self.pieces: list[str] = [initial] if initial else []
        self.chars = len(initial)
        self.ended = False
        self.tokens = 0  # text tokens the worker committed so far (its TextCommitted)
        self._append: Callable[[str], None] | None = None
        self._end: Callable[[], None] | None = None

    @property
    def text(self) -> str:
        """All the text so far: joins every piece (its cost grows with the text), so it is read
        once (an attach, the end's checks), never per piece; `chars` is the running count."""
        return "".join(self.pieces)

    def append(self, text: str) -> None:
        if self.ended:
            raise ValueError("text appended after its end")
        if not text:
            return
        self.pieces.append(text)
        self.chars += len(text)
        if self._append is not None:
            self._append(text)

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._end is not None:
            self._end()

    def attach(self, append: Callable[[str], None], end: Callable[[], None]) -> None:
        """Send the text so far (one piece: the tokenization does not depend on the split) and
        every later piece through `append`, and the end through `end`."""
        if self.pieces:
            append(self.text)
        if self.ended:
            end()
        self._append, self._end = append, end

    def detach(self) -> None:
        self._append = self._end = None
