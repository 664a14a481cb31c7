"""The text side of one stream: its layout, the text it feeds per frame, when it may end.

A stream's talker input after each frame is the frame's codec embeddings plus a text term
(`prompts.py`). In the "prompt" layout that term is always `tts_pad`. In the dual-track layout
it is the next text token (at most `pace` tokens per frame: 1.0 is the reference code's one per
frame; below it a frame with no token due gets `tts_pad`), then `tts_eos`, then `tts_pad`. Text
that is streamed in (`IncrementalText`) may not have arrived when its token is due: then the
track answers WAIT and the stream waits out of the batch; pad never stands in for text that
has not come. EOS is refused for the first MIN_FRAMES frames (the reference's
`min_new_tokens=2`) and, dual-track, until `tts_eos` has been fed: so a stream never ends while
its text is open, and a whole text and the same text streamed in pieces give the same codes.
"""

from __future__ import annotations

import math

import mlx.core as mx

from qwen3_tts_engine.protocol import (
    DEFAULT_TEXT_PACE,
    DEFAULT_TEXT_START_TOKENS,
    RequestError,
    SpeechRequest,
)
from qwen3_tts_engine.rules import Voice
from qwen3_tts_engine.worker.incremental_text import IncrementalText, text_token_ids
from qwen3_tts_engine.worker.prompts import build_prompt, role_ids, text_embeddings

MIN_FRAMES = 2  # the reference code's min_new_tokens: EOS is not sampled for frames 0 and 1
WAIT = None  # `TextTrack.term`: the token due has not arrived


class TextTrack:
    """One sentence's text: a whole text (`text`) or one streamed in (`feed`)."""

    def __init__(self, model, req: SpeechRequest, mode: str, *, text: str | None = None,
                 feed: IncrementalText | None = None) -> None:  # fmt: skip
        self.model = model
        self.req = req
        self.mode = mode
        self.pace = req.text_pace or DEFAULT_TEXT_PACE
        self.start_tokens = req.text_start_tokens or DEFAULT_TEXT_START_TOKENS
        self.text = text
        self.feed = feed
        self.trailing: list[mx.array] = []  # [1, 1, H] per trailing entry known so far
        self.trailing_ids: list[int] = []
        self.fed = 0  # trailing entries fed
        self.fed_ids: list[int] = []  # the text-track ids fed, prompt's first token included
        self.eos_fed = mode == "prompt"
        self.started = False
        self.pad: mx.array | None = None
        self._eos_id = model.config.tts_eos_token_id

    @property
    def streamed(self) -> bool:
        return self.feed is not None

    @property
    def ended(self) -> bool:
        return self.feed is None or self.feed.ended

    @property
    def waiting(self) -> bool:
        """Streamed text that has not started and cannot yet (too little text so far)."""
        return not self.started and not self.ready()

    def ready(self) -> bool:
        """Enough text to prefill: the start threshold's worth of tokens, or all of it."""
        if self.feed is None:
            return True
        return self.feed.ended or len(self.feed.ids) >= self.start_tokens

    def prompt(self, voice: Voice, ref_audio: mx.array | None) -> mx.array:
        """The prompt embeddings [1, L, H]; the trailing text starts from here."""
        tokenizer = self.model.tokenizer
        if self.feed is not None:
            ids, role, ended = list(self.feed.ids), self.feed.head_ids, self.feed.ended
            if not ids:
                raise RequestError("input has no text to speak", param="input")
        elif self.mode == "dual":
            ids, role, ended = (
                text_token_ids(tokenizer, self.text),
                role_ids(self.model, self.text),
                True,
            )
        else:
            ids, role, ended = [], [], True
        p = build_prompt(self.model, self.req, voice, ref_audio, mode=self.mode, text=ids or [0],
                         role=role, text_ended=ended,
                         source_text=self.text if self.mode == "prompt" else None)  # fmt: skip
        self.pad = p.pad
        self.started = True
        if self.mode == "dual":
            self.eos_fed = p.eos_in_prompt
            consumed = len(ids) - len([i for i in p.trailing_ids if i != self._eos_id])
            self.fed_ids = ids[:consumed]
            self._extend(p.trailing_ids, p.trailing)
        return p.embeds

    def append(self, text: str) -> int:
        """Streamed text arrives; returns the text tokens committed so far."""
        new = self.feed.append(text)
        if self.started and new:
            self._extend(new, text_embeddings(self.model, new))
        return len(self.feed.ids)

    def end(self) -> int:
        """The streamed text is complete: the held-back rest, then `tts_eos`."""
        if self.feed.ended:
            return len(self.feed.ids)
        new = self.feed.end()
        if self.started:
            tail = [*new, self._eos_id]
            self._extend(tail, text_embeddings(self.model, tail))
        return len(self.feed.ids)

    def _extend(self, ids: list[int], embeds: mx.array | None) -> None:
        for i, tok in enumerate(ids):
            self.trailing_ids.append(tok)
            self.trailing.append(embeds[:, i : i + 1, :])

    def term(self, frame: int) -> mx.array | None:
        """The text term of the input after frame `frame` (0-based), or WAIT."""
        if self.mode == "prompt":
            return self.pad
        due = math.floor((frame + 1) * self.pace + 1e-9)  # trailing entries fed after this frame
        if self.fed >= due:
            return self.pad  # pacing: no token due at this frame
        if self.fed < len(self.trailing):
            tok = self.trailing_ids[self.fed]
            term = self.trailing[self.fed]
            self.fed += 1
            if tok == self._eos_id and self.ended and self.fed == len(self.trailing):
                self.eos_fed = True
            else:
                self.fed_ids.append(tok)
            return term
        return WAIT if not self.ended else self.pad

    def eos_allowed(self, frame: int) -> bool:
        """Whether frame `frame` (0-based) may be the codec EOS."""
        return frame >= MIN_FRAMES and self.eos_fed
