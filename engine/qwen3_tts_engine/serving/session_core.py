"""The decisions of every speech socket, without I/O: an utterance's states and which command each
allows, the texts waiting their turn (`Backlog`, bounded), and where text is cut into sentences.

The socket (`socket_session.py`) runs them; each dialect (`speech_stream.py`, `qwen_realtime.py`,
`vllm_omni_stream.py`) translates its messages into the commands (configure, append, flush,
cancel, close) and the socket's events (started, audio, sentence done, done with a finish
reason, error, closed) into its own messages. docs/engine-api.md has the mapping side by side.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from typing import Generic, Protocol, TypeVar

from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import Limits, RequestError, check_input, check_length, check_text


class State(enum.Enum):
    """One utterance's state. WAITING: started (configured), no text yet, no stream; TEXT_OPEN:
    its text arrives and its synthesis runs; FLUSHING: its text has ended, its audio still comes;
    DONE / CANCELLED: over (its done event went out)."""

    WAITING = "waiting"
    TEXT_OPEN = "text_open"
    FLUSHING = "flushing"
    DONE = "done"
    CANCELLED = "cancelled"


class Command(enum.Enum):
    CONFIGURE = "configure"
    APPEND = "append"
    FLUSH = "flush"
    CANCEL = "cancel"
    CLOSE = "close"


# What each state of the current utterance allows (a command not here is one error, decided once):
# a new utterance is configured only when none is in progress; append and flush while the text
# is open; cancel and close at any time.
ALLOWED = {
    None: {Command.CONFIGURE, Command.CLOSE},
    State.WAITING: {Command.APPEND, Command.FLUSH, Command.CANCEL, Command.CLOSE},
    State.TEXT_OPEN: {Command.APPEND, Command.FLUSH, Command.CANCEL, Command.CLOSE},
    State.FLUSHING: {Command.CANCEL, Command.CLOSE},
    State.DONE: {Command.CONFIGURE, Command.CLOSE},
    State.CANCELLED: {Command.CONFIGURE, Command.CLOSE},
}
OVER = (State.DONE, State.CANCELLED)
# The moves an utterance makes (its first text starts its synthesis; the end of its text, its
# last audio, a cancel); anything else is a bug, not a client's error.
MOVES = {
    State.WAITING: {State.TEXT_OPEN, State.FLUSHING, State.DONE, State.CANCELLED},
    State.TEXT_OPEN: {State.FLUSHING, State.DONE, State.CANCELLED},
    State.FLUSHING: {State.DONE, State.CANCELLED},
    State.DONE: set(),
    State.CANCELLED: set(),
}


def allowed(state: State | None, command: Command) -> bool:
    return command in ALLOWED[state]


def check_piece(text: object, param: str, limits: Limits) -> str:
    """A piece of text as a message brings it: a string, well formed, and no longer than one
    utterance may be (POST's error for a long `input`), so a 3 MB message is refused before
    anything is cut or queued."""
    if not isinstance(text, str):
        raise RequestError(f"the text piece needs a string `{param}`", param=param)
    check_text(text, param)
    check_length(len(text), limits)
    return text


# Unit ends (vLLM-Omni's text splitter's, without its abbreviation rules): ASCII . ! ?
# before whitespace or the end of a piece, script marks anywhere; clauses add , ; and their
# script forms. Closing quotes and brackets stay with the unit they close.
_CLOSERS = "\"'”’»)\\]}』」）】"
_ENDS = {
    "sentence": re.compile(rf"[.!?…]+[{_CLOSERS}]*(?=\s|$)|[。！？।॥؟]+[{_CLOSERS}]*"),
    "clause": re.compile(rf"[.!?…,;]+[{_CLOSERS}]*(?=\s|$)|[。！？।॥؟，；、،؛]+[{_CLOSERS}]*"),
}
SPLITS = ("none", "sentence", "clause")


def split_parts(piece: str, granularity: str = "sentence") -> list[tuple[str, bool]]:
    """`piece` cut after each unit end: [(part, whether it ends a unit)], in order. A piece that
    ends with "." ends its unit (a number cut as "3." + "5" is cut there too)."""
    if granularity == "none":
        return [(piece, False)] if piece else []
    parts, at = [], 0
    for m in _ENDS[granularity].finditer(piece):
        parts.append((piece[at : m.end()], True))
        at = m.end()
    if at < len(piece):
        parts.append((piece[at:], False))
    return parts


class HasText(Protocol):
    text: TextInput


T = TypeVar("T", bound=HasText)


class Backlog(Generic[T]):
    """The texts waiting their turn, in order, each one utterance (a dialect's item that holds a
    `TextInput`), and markers between them (e.g. a flush's end); `open` is the one still growing
    (already queued). At most `max_pending` texts wait: past that a unit end is not cut and the
    text joins the last one, whose length `limits.max_input_chars` bounds. So a flood of short sentences
    costs at most max_pending x max_input_chars characters."""

    def __init__(self, max_pending: int, limits: Limits) -> None:
        self.items: deque[T | object] = deque()
        self.open: T | None = None
        self.max_pending = max_pending
        self.limits = limits
        self.waiting = 0  # texts in `items`

    def add(self, part: str, ends: bool, new) -> None:
        """Append `part` to the open text (a new one from `new()` if none is open; blank text
        opens none); `ends`: it ends its unit (cut, while there is room)."""
        if self.open is None:
            if not part.strip():
                return  # the space between two sentences starts none
            self.open = new()
            self.items.append(self.open)
            self.waiting += 1
        check_length(self.open.text.chars + len(part), self.limits)
        self.open.text.append(part)  # to the worker at once if it is speaking
        if ends and self.waiting < self.max_pending:
            self.close_open()

    def close_open(self) -> None:
        """The open text is whole (a unit end, a flush)."""
        if self.open is not None:
            item, self.open = self.open, None
            check_input(item.text.text, self.limits)  # as POST checks `input`
            item.text.end()

    def push(self, item: T) -> None:
        """A whole text (e.g. a commit), behind the others; refused (429) past max_pending."""
        if self.waiting >= self.max_pending:
            raise RequestError(f"{self.waiting} texts are waiting their turn already "
                               "(ws_max_pending)", status=429)  # fmt: skip
        check_input(item.text.text, self.limits)
        item.text.end()
        self.items.append(item)
        self.waiting += 1

    def mark(self, marker: object) -> None:
        self.items.append(marker)

    def pop(self) -> T | object | None:
        """The next item in turn (a text leaves the count when it begins)."""
        if not self.items:
            return None
        item = self.items.popleft()
        if hasattr(item, "text") and isinstance(item.text, TextInput):
            self.waiting -= 1
        return item

    def drop_open(self) -> T | None:
        """The open text is dropped (if it has not begun, it leaves the queue)."""
        item, self.open = self.open, None
        if item is not None and item in self.items:
            self.items.remove(item)
            self.waiting -= 1
        return item

    def clear(self) -> None:
        self.items.clear()
        self.open = None
        self.waiting = 0
