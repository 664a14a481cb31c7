"""Text transforms for what the agent speaks, beside LiveKit's own (`filter_markdown`,
`filter_emoji`): they run on the LLM's streamed reply before the TTS sees it."""

from __future__ import annotations

import unicodedata
from collections.abc import AsyncIterable

from livekit.agents.voice.agent_session import DEFAULT_TTS_TEXT_TRANSFORMS

KEPT_CONTROLS = frozenset("\t\n\r")  # white space that sentence splitting reads


def unspeakable(c: str) -> bool:
    """Control (but tab and line ends), format (zero-width spaces and joiners, BOM, bidi marks,
    soft hyphen) and surrogate characters: nothing to say, and text of only these is refused by
    the engine (a TTS error in LiveKit: "no audio frames were pushed")."""
    return unicodedata.category(c) in ("Cc", "Cf", "Cs") and c not in KEPT_CONTROLS


async def filter_unspeakable(text: AsyncIterable[str]) -> AsyncIterable[str]:
    """Drop `unspeakable` characters: a reply made only of them is silence, not an error."""
    async for chunk in text:
        yield "".join(c for c in chunk if not unspeakable(c))


# LiveKit's defaults, then ours
TTS_TEXT_TRANSFORMS = [*DEFAULT_TTS_TEXT_TRANSFORMS, filter_unspeakable]
