"""Text that arrives in pieces, tokenized exactly: the ids fed equal the final text's ids.

Qwen3-TTS feeds the talker the ids of `<|im_start|>assistant\\n{text}<|im_end|>\\n...` without
the 3 leading and 5 trailing template ids (`text_token_ids`). When the text comes in pieces (an
LLM's output), an id may only be fed once no later piece can change it. The tokenizer is
byte-level BPE over pre-tokenized chunks (Qwen2's split regex) after NFC, and BPE never merges
across chunks, so an id is final once the chunking before it is final. A boundary is committed
only where that holds whatever follows: the trailing chunk (a partial word) is held back, and so
is trailing whitespace (a run of whitespace re-splits with what follows it), a character that
NFC could compose with the next one, and a tail that could still become an added token
(`<think>`). `end()` commits the rest.

The work per piece is bounded, whatever the script: at most `HELD_MAX` characters are held back.
Text with no safe boundary for that long (CJK without punctuation is one pre-tokenizer chunk, as
is a long run of letters, spaces or combining marks) gets a forced commit point: the text held is
tokenized in a window of `HELD_MAX` + margin characters and committed up to the window's last
clean token boundary at least the margin before its end (`MIN_MARGIN`, or the longest added
token if longer: an added token is never cut). BPE merges are local, so with that much text after it such a boundary is almost
always one the whole text has too: the ids equal the whole text's (tests/engine/worker/
test_incremental_text.py shows it on a BPE with CJK merges); where a merge did span it, the two
sides are tokenized apart (the same characters, a different split: the talker reads the same
text). Each piece thus costs the tokenizer its own length plus at most a bounded re-read.
"""

from __future__ import annotations

import re
import unicodedata

# what precedes the text in the chat template once `<|im_start|>` is split off, and how many ids
# of the template's own the reference drops there (`input_id[:, 3:]`: `<|im_start|>` + these 2)
_TEMPLATE_HEAD = "assistant\n"
_TEMPLATE_IDS = 2
HELD_MAX = 64  # characters held back at most: past this, a commit point is forced
# the characters a forced cut leaves after it in its window: this, or the longest added token
MIN_MARGIN = 16
# A piece's own characters are read by the tokenizer at most this often (once for its natural
# boundary, once when committed, at most twice in the overlapping windows of forced cuts);
# `reread_max` counts the reading beyond that: of earlier pieces' text, bounded by HELD_MAX.
READS_PER_CHAR = 4


def chat_text(text: str) -> str:
    """The reference code's prompt text around `text` (qwen3_tts_model.py `_build_assistant_text`)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def text_token_ids(tokenizer, text: str) -> list[int]:
    """The text ids the talker is fed for `text`, as the reference slices them (`[3:-5]`)."""
    return list(tokenizer.encode(chat_text(text)))[3:-5]


class IncrementalText:
    """Pieces of text in, committed text ids out (`append`, `end`); `ids` is all committed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pre = tokenizer.backend_tokenizer.pre_tokenizer
        added = sorted(tokenizer.added_tokens_encoder, key=len, reverse=True)
        self._added = added
        self._added_re = re.compile("|".join(re.escape(t) for t in added)) if added else None
        self._added_firsts = {t[0] for t in added}
        self.margin = max(MIN_MARGIN, *(len(t) for t in added))
        self._pending = _TEMPLATE_HEAD  # NFC text not committed yet, from a committed boundary
        self._skip = _TEMPLATE_IDS
        # the 3 role ids the reference takes from the chat text (`input_id[:, :3]`)
        self.head_ids: list[int] = [tokenizer.convert_tokens_to_ids("<|im_start|>")]
        self.ids: list[int] = []
        self.chars = 0  # characters received (before normalization)
        self.ended = False
        # the tokenizer's work: characters it read for one piece beyond READS_PER_CHAR per
        # character of the piece (the re-reading of earlier pieces' text), the most so far
        self.reread_max = 0
        self.forced = 0  # forced commit points so far
        self._read = 0  # characters given to the tokenizer by the current call

    @property
    def held(self) -> str:
        """The text received but not committed yet."""
        return self._pending.removeprefix(_TEMPLATE_HEAD) if self._skip else self._pending

    def append(self, text: str) -> list[int]:
        """Add a piece (any split, even inside a word or a character sequence); returns the ids
        committed by it."""
        if self.ended:
            raise ValueError("text appended after the end")
        self.chars += len(text)
        self._read = 0
        # NFC(NFC(a) + b) == NFC(a + b): the pending text stays normalized as pieces come
        self._pending = unicodedata.normalize("NFC", self._pending + text)
        ids = self._commit(self._stable_cut())
        if len(self.held) > HELD_MAX:
            ids += self._force()
        self.reread_max = max(self.reread_max, self._read - READS_PER_CHAR * len(text))
        return ids

    def end(self) -> list[int]:
        """No more text: commit what is held back."""
        if self.ended:
            return []
        self.ended = True
        return self._commit(len(self._pending))

    def _commit(self, cut: int) -> list[int]:
        if cut <= 0:
            return []
        piece, self._pending = self._pending[:cut], self._pending[cut:]
        self._read += len(piece)
        return self._take(list(self.tokenizer.encode(piece, add_special_tokens=False)))

    def _take(self, ids: list[int]) -> list[int]:
        """Commit `ids` (the template's own leading ids go to `head_ids`)."""
        if self._skip:
            dropped = min(self._skip, len(ids))
            self.head_ids += ids[:dropped]
            ids, self._skip = ids[dropped:], self._skip - dropped
        self.ids.extend(ids)
        return ids

    def _force(self) -> list[int]:
        """Forced commit points until at most `HELD_MAX` characters are held back, each from a
        window of bounded size (a long piece is walked through, never re-read whole)."""
        text, pos, ids = self._pending, 0, []
        head = len(text) - len(self.held)  # the template's head, which `held` leaves out
        while len(text) - pos - (head if pos < head else 0) > HELD_MAX:
            window = text[pos : pos + HELD_MAX + self.margin]
            enc = self.tokenizer.backend_tokenizer.encode(window, add_special_tokens=False)
            self._read += len(window)
            cut, count = self._forced_cut(window, enc.offsets)
            ids += self._take(list(enc.ids[:count]))
            pos += cut
            self.forced += 1
        self._pending = text[pos:]
        return ids

    def _forced_cut(self, window: str, offsets: list[tuple[int, int]]) -> tuple[int, int]:
        """(characters, tokens) of the window to commit: up to its last clean token boundary (no
        token spans it: byte-level tokens may split a character) at most `margin` characters
        before the window's end, one NFC leaves apart if there is one; else its first."""
        ends = [
            (end, i + 1)
            for i, (_, end) in enumerate(offsets)
            if 0 < end and (i + 1 == len(offsets) or offsets[i + 1][0] >= end)
        ]
        if not ends:
            return len(window), len(offsets)
        inner = [(e, n) for e, n in ends if e <= len(window) - self.margin]
        safe = [(e, n) for e, n in inner if e == len(window) or self._safe(window, e)]
        return (safe or inner or ends)[-1 if safe or inner else 0]

    def _stable_cut(self) -> int:
        """The longest prefix of the pending text whose ids no later text can change."""
        text = self._pending
        self._read += len(text)
        starts = self._chunk_starts(text)
        limit = self._added_prefix_start(text)
        # the last chunk is held back (the partial word); then walk back to a safe boundary
        for cut in reversed(starts[1:]):
            if cut <= limit and self._safe(text, cut):
                return cut
        return 0

    def _chunk_starts(self, text: str) -> list[int]:
        """Where the tokenizer's chunks start (added tokens are chunks of their own)."""
        starts: list[int] = []
        pos = 0
        matches = list(self._added_re.finditer(text)) if self._added_re else []
        for m in [*matches, None]:
            end = m.start() if m is not None else len(text)
            if end > pos:
                starts.extend(pos + a for _, (a, _b) in self._pre.pre_tokenize_str(text[pos:end]))
            if m is not None:
                starts.append(m.start())
                pos = m.end()
        return starts

    def _added_prefix_start(self, text: str) -> int:
        """The earliest position from which the text's end could still become an added token."""
        for i in range(
            max(0, len(text) - max((len(t) for t in self._added), default=0)), len(text)
        ):
            if text[i] not in self._added_firsts:
                continue
            tail = text[i:]
            if any(t.startswith(tail) and t != tail for t in self._added):
                return i
        return len(text)

    @staticmethod
    def _safe(text: str, cut: int) -> bool:
        """A boundary is final when the text before it ends in a non-space (a whitespace run
        re-splits with what follows) and NFC leaves the two characters around it apart."""
        before, after = text[cut - 1], text[cut]
        if before.isspace() or unicodedata.combining(after):
            return False
        return unicodedata.normalize("NFC", before + after) == before + after
