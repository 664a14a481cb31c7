"""A cheap end-of-turn check on the transcript, for when no turn-detector model is on disk.

LiveKit asks a turn detector for the probability that the user has finished once the VAD reports
the end of speech; below `unlikely_threshold` it waits `max_delay` instead of `min_delay` for the
user to go on. This one says "unlikely" when the transcript trails off: its last word is a
conjunction, preposition, article, possessive or filler ("I would like to book a table for"), or
it ends with a comma, dash or ellipsis. Whisper punctuates what it hears ("the weather in?"), so a
final period or question mark does not count. The price: a question that ends with a preposition
("Where are you from?") waits `max_delay`.
"""

from __future__ import annotations

import re

from livekit.agents import llm

TRAILING_WORDS = frozenset("""
    and or but so because although though if unless than whose
    for to of in on at with from by about into onto over under between after before during
    without through toward towards around near
    the a an my your his her our their every
    um uh er erm uhm
    i'd i'm i'll we're you're let's
""".split())  # fmt: skip
TRAILING_MARKS = (",", ";", ":", "-", "\u2013", "\u2014", "...", "\u2026")
_WORD = re.compile(r"[a-z']+")


def sounds_unfinished(text: str) -> bool:
    """The transcript trails off (see the module docstring)."""
    text = text.strip().lower()
    if not text:
        return False
    if text.endswith(TRAILING_MARKS):
        return True
    words = _WORD.findall(text)
    return bool(words) and words[-1] in TRAILING_WORDS


class RuleTurnDetector:
    """LiveKit's turn-detector protocol (`predict_end_of_turn` on the chat context), by rule."""

    def __init__(self, *, unfinished: float = 0.05, finished: float = 0.95,
                 threshold: float = 0.5) -> None:  # fmt: skip
        self._unfinished, self._finished, self._threshold = unfinished, finished, threshold

    @property
    def model(self) -> str:
        return "trailing-words"

    @property
    def provider(self) -> str:
        return "voice-agent"

    async def unlikely_threshold(self, language) -> float | None:
        return self._threshold

    async def supports_language(self, language) -> bool:
        return language is None or str(language).lower().startswith(
            "en"
        )  # the word list is English

    async def predict_end_of_turn(
        self, chat_ctx: llm.ChatContext, *, timeout: float | None = None
    ) -> float:
        users = [m for m in chat_ctx.items if isinstance(m, llm.ChatMessage) and m.role == "user"]
        text = (users[-1].text_content or "") if users else ""
        return self._unfinished if sounds_unfinished(text) else self._finished
