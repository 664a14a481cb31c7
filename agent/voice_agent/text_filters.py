"""Text transforms for what the agent speaks, beside LiveKit's own (`filter_markdown`,
`filter_emoji`): they run on the LLM's streamed reply before the TTS sees it."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import AsyncIterable, AsyncIterator

from livekit.agents.voice.agent_session import DEFAULT_TTS_TEXT_TRANSFORMS
from livekit.agents.voice.transcription.filters import filter_markdown

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


# Characters that may begin or end markdown in LiveKit's filter (its line, full-line and inline
# patterns and their openers), and the line end; text without them it passes on unchanged.
MARKUP = re.compile(r"[#\-+*_>!`~\[\]()|\n\\<]")


async def filter_markdown_plain_now(text: AsyncIterable[str]) -> AsyncIterable[str]:
    """LiveKit's `filter_markdown`, but the reply's plain start goes on as it comes.

    LiveKit's filter holds each piece's last word, and the space or punctuation after it, until
    the next piece (more text could make it markup). The engine in turn commits a word once it
    sees what follows it. So the reply's first word reached the model two LLM tokens after it
    was written instead of one (`voice-agent bench --llm-pace`: 33 ms at 30 tokens/s). Text with
    no `MARKUP` character, a non-space first, is what LiveKit's filter passes on unchanged and no
    later pattern reaches back into (each begins at a marker, or at a line start after spaces
    only). So until the first such character: pieces go on at once. From there LiveKit's filter
    reads the whole reply (its state as if it had from the start) and what it yields after the
    part already sent goes on."""
    sent = ""  # passed on before LiveKit's filter took over
    upstream = aiter(text)
    async for piece in upstream:
        if MARKUP.search(piece) or not (sent + piece).strip():
            break
        sent += piece
        yield piece
    else:
        return

    async def whole() -> AsyncIterator[str]:
        yield sent
        yield piece
        async for rest in upstream:
            yield rest

    skip = len(sent)
    async for out in filter_markdown(whole()):
        if skip:  # its copy of what was sent (the same characters: see above)
            out, skip = out[skip:], max(0, skip - len(out))
        if out:
            yield out


# LiveKit's defaults (its markdown filter with the plain start sent at once), then ours
TTS_TEXT_TRANSFORMS = [
    filter_markdown_plain_now if t == "filter_markdown" else t for t in DEFAULT_TTS_TEXT_TRANSFORMS
] + [filter_unspeakable]
