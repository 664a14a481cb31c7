"""Text that arrives in pieces, tokenized exactly: the ids fed equal the final text's ids.

Qwen3-TTS feeds the talker the ids of `<|im_start|>assistant\\n{text}<|im_end|>\\n...` without
the 3 leading and 5 trailing template ids (`text_token_ids`). When the text comes in pieces (an
LLM's output), an id may only be fed once no later piece can change it. The tokenizer is
byte-level BPE over pre-tokenized chunks (Qwen2's split regex) after NFC, and BPE never merges
across chunks, so an id is final once the chunking before it is final. A boundary is committed
only where that holds whatever follows: the trailing chunk (a partial word) is held back, and so
is trailing whitespace (a run of whitespace re-splits with what follows it), a character that
NFC could compose with the next one, and a tail that could still become an added token
(`<think>`). CJK text without punctuation is one chunk: it is committed at punctuation or the
end. `end()` commits the rest.
"""

from __future__ import annotations

import re
import unicodedata

# what precedes the text in the chat template once `<|im_start|>` is split off, and how many ids
# of the template's own the reference drops there (`input_id[:, 3:]`: `<|im_start|>` + these 2)
_TEMPLATE_HEAD = "assistant\n"
_TEMPLATE_IDS = 2


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
        self._pending = _TEMPLATE_HEAD  # NFC text not committed yet, from a committed boundary
        self._skip = _TEMPLATE_IDS
        # the 3 role ids the reference takes from the chat text (`input_id[:, :3]`)
        self.head_ids: list[int] = [tokenizer.convert_tokens_to_ids("<|im_start|>")]
        self.ids: list[int] = []
        self.chars = 0  # characters received (before normalization)
        self.ended = False

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
        # NFC(NFC(a) + b) == NFC(a + b): the pending text stays normalized as pieces come
        self._pending = unicodedata.normalize("NFC", self._pending + text)
        return self._commit(self._stable_cut())

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
        ids = list(self.tokenizer.encode(piece, add_special_tokens=False))
        if self._skip:
            dropped = min(self._skip, len(ids))
            self.head_ids += ids[:dropped]
            ids, self._skip = ids[dropped:], self._skip - dropped
        self.ids.extend(ids)
        return ids

    def _stable_cut(self) -> int:
        """The longest prefix of the pending text whose ids no later text can change."""
        text = self._pending
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
