"""Streamed text costs the worker per piece, not per text so far (issue 50; incremental_text.py).

A real engine on the tiny checkpoint: one caller appends 10,000 one-character pieces of Chinese
with no punctuation (one pre-tokenizer chunk: before the forced commit points it was never
committed, and each piece re-tokenized all of it), while another caller asks for a sentence.
The appends go in bursts of 100, each after the worker acknowledged the one before (its
committed token count grew: a forced commit comes at least every 64 held characters, so an
acknowledgement must come), until the other caller has its first audio; then the rest at once.
Shown by events: the other caller's first audio arrives while the appends are still going, and
the worker's own count of characters it re-tokenized for one piece stays under a bound that
does not grow with the text (a count, not a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from qwen3_tts_engine import Engine, Handler
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.worker.incremental_text import HELD_MAX

pytestmark = pytest.mark.slow
HANG_GUARD_S = 180.0
PIECES = 10_000
BURST = 100  # > HELD_MAX: each burst forces at least one commit, so its acknowledgement comes
REREAD_BOUND = 2 * (HELD_MAX + 32)  # as tests/engine/worker/test_incremental_text.py


@pytest.fixture(scope="module")
async def engine(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    eng = Engine(model, [Handler(model, max_batch=2, frame_budget_s=None)])
    await eng.start()
    yield eng
    await eng.stop()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


async def test_ten_thousand_one_character_appends_do_not_stall_another_callers_first_audio(engine):
    rng = random.Random(3)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(PIECES))
    text = TextInput()
    abuser = engine.stream(
        SpeechRequest(input="", voice="ryan", seed=5, text_stream=True), text=text
    )
    appended = 0
    heard_at: int | None = None  # pieces appended when the other caller's first audio came

    async def read_abuser() -> None:
        async for _ in abuser:
            pass

    async def other() -> int:
        nonlocal heard_at
        req = SpeechRequest(input="Hello there, how are you?", voice="ryan", seed=1)
        samples = 0
        async with contextlib.aclosing(engine.stream(req)) as chunks:
            async for chunk in chunks:
                heard_at = appended if heard_at is None else heard_at
                samples += len(chunk.pcm) // 2
        return samples

    reader = asyncio.create_task(read_abuser())
    caller: asyncio.Task | None = None
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            while appended < PIECES:
                tokens = text.tokens
                for ch in cjk[appended : appended + BURST]:
                    text.append(ch)
                    appended += 1
                if heard_at is None:  # paced by the worker until the other caller has audio
                    await _until(lambda t=tokens: text.tokens > t or reader.done())
                    assert not reader.done(), reader
                    caller = caller or asyncio.create_task(other())
                else:
                    await asyncio.sleep(0)
            assert heard_at is not None and heard_at < PIECES, heard_at
            assert await caller > 0
            # the worker has tokenized them all (at most HELD_MAX characters held back, each
            # character three byte-level ids with this tokenizer) before the abuser is cancelled
            await _until(lambda: text.tokens >= 3 * (PIECES - HELD_MAX) or reader.done())
            assert not reader.done(), reader
    finally:
        reader.cancel()  # the abuser's stream is cancelled: its stats come with the cancel
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await abuser.aclose()
        if caller is not None and not caller.done():
            caller.cancel()
    stats = [s for s in engine.active.history if s.get("text_forced_commits")]
    assert stats, "the abuser's stream reported its text work"
    work = stats[-1]
    # every one of the 10,000 characters reached the worker: ~3 ids each (no CJK merges here)
    assert work["text_forced_commits"] >= PIECES // HELD_MAX
    assert work["text_reread_max"] <= REREAD_BOUND
