"""Held streams lend their real-time slots (issue 50, flow control; dispatch/capacity.py).

A real engine on the tiny checkpoint whose utterances end by EOS (deterministic for a text and a
seed), two slots (no frame budget: slots = max_batch = 2), its `/load` read over real HTTP on
127.0.0.1. Streams are held two ways: a consumer that stops iterating `Engine.stream` (the
worker pauses the stream after two untaken chunks), and streamed text that is open and used up.
With both slots held, a third request must still get its first audio: the order is shown by the
engine's state when that audio arrives (the held streams are still held), never by time. Without
the lending, the third request would wait for a slot the held streams never give up and the
test would end at its hang guard.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.dispatch.handler import Result
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import LoadReport, SpeechRequest

pytestmark = pytest.mark.slow
HANG_GUARD_S = 180.0
TEXT = "Hold this line for a while, please."
SLOTS = 2


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    handler = Handler(model, max_batch=SLOTS, max_queue=4, frame_budget_s=None)
    srv = EngineServer(Engine(model, [handler]), ServerConfig(port=0))
    await srv.start()
    yield srv
    await srv.stop()


def _req(seed: int, **kw) -> SpeechRequest:
    return SpeechRequest(input=TEXT, voice="ryan", language="english", seed=seed, **kw)


async def _load(srv: EngineServer) -> LoadReport:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as client:
        r = await client.get("/load")
    assert r.status_code == 200, r.text
    return LoadReport.from_json(r.json())


async def _until_load(srv: EngineServer, ok) -> LoadReport:
    """Poll /load until `ok(load)` (an engine state), bounded by the hang guard."""
    while not ok(load := await _load(srv)):
        await asyncio.sleep(0.02)
    return load


async def _samples(chunks) -> int:
    return sum([len(c.pcm) // 2 async for c in chunks])


async def _solo(engine: Engine, req: SpeechRequest, text: str | None = None) -> int:
    """An unheld run of `req` (its streamed text given whole and ended at once)."""
    feed = None
    if text is not None:
        feed = TextInput(text)
        feed.end()
    async with contextlib.aclosing(engine.stream(req, text=feed)) as chunks:
        return await _samples(chunks)


async def _third_speaks_while_held(srv: EngineServer) -> None:
    """A third request gets its first audio while both slots' streams are held."""
    third = srv.engine.stream(_req(seed=9))
    async with contextlib.aclosing(third):
        first = await anext(third)
        load = await _load(srv)  # the state when its first audio came
        assert first.index == 0
        assert load.held == SLOTS and load.running <= 1, load
        assert load.server_load == load.running + load.waiting
        await _samples(third)


async def test_streams_whose_consumers_stop_reading_lend_their_slots(server):
    engine = server.engine
    async with asyncio.timeout(HANG_GUARD_S), contextlib.AsyncExitStack() as stack:
        held = [engine.stream(_req(seed=s), result=Result()) for s in (1, 2)]
        for it in held:
            stack.push_async_callback(it.aclose)
        got = []
        for n, it in enumerate(held, 1):  # one after the other: every stream here runs alone,
            got.append([await anext(it)])  # so its codes are its solo run's, float for float
            load = await _until_load(server, lambda lo, n=n: lo.held == n)  # read one, then none
        assert (load.running, load.waiting, load.free_slots) == (0, 0, SLOTS)
        assert engine.active.batching.get("held_streams", SLOTS) <= SLOTS

        await _third_speaks_while_held(server)

        # the held ones resume (their slots back, ahead of anyone new) and finish whole
        for it, chunks in zip(held, got, strict=True):
            chunks += [c async for c in it]
        await _until_load(server, lambda lo: (lo.running, lo.held) == (0, 0))
        for seed, chunks in zip((1, 2), got, strict=True):
            assert [c.index for c in chunks] == list(range(len(chunks)))
            assert len(chunks) >= 3  # two untaken chunks paused it before its end
            assert sum(len(c.pcm) // 2 for c in chunks) == await _solo(engine, _req(seed=seed))
    stats = [h for h in engine.active.history if h.get("resumed_chunks")]
    assert stats, "a held stream's chunk after it resumed is counted as resumed (never late)"


async def test_streams_waiting_for_their_text_lend_their_slots(server):
    engine = server.engine
    first_part, rest = "Hold this line ", TEXT.removeprefix("Hold this line ")
    async with asyncio.timeout(HANG_GUARD_S):
        texts = [TextInput(first_part) for _ in range(SLOTS)]
        reqs = [_req(seed=s, text_stream=True) for s in (3, 4)]

        async def read(req, text) -> int:  # a consumer that reads all it is given
            async with contextlib.aclosing(engine.stream(req, text=text)) as chunks:
                return await _samples(chunks)

        readers = []
        try:
            # each starts, speaks the text it has and waits out of the batch for more (one after
            # the other, and they finish one after the other: each runs alone, as its solo run)
            for n, (req, text) in enumerate(zip(reqs, texts, strict=True), 1):
                readers.append(asyncio.create_task(read(req, text)))
                load = await _until_load(server, lambda lo, n=n: lo.held == n)
            assert load.running == 0 and not any(r.done() for r in readers)
            before = engine.active.batching.get("text_waits")

            await _third_speaks_while_held(server)

            samples = []
            for text, reader in zip(texts, readers, strict=True):
                text.append(rest)
                text.end()
                samples.append(await reader)
        finally:
            for r in readers:
                r.cancel()
        await _until_load(server, lambda lo: (lo.running, lo.held) == (0, 0))
        for req, n in zip(reqs, samples, strict=True):
            assert n == await _solo(engine, req, TEXT)
    assert before is None or before >= 1


async def test_a_held_consumers_text_is_still_acknowledged(server):
    """The committed token count (a socket's `input_text.ack`) follows the worker while the
    stream's consumer is held: it is not left in the messages the consumer has not read."""
    engine = server.engine
    # more text than its first two chunks speak: it is held by its consumer, not by its text
    text = TextInput("Hold this line for a while, please, and then a little longer, as long as ")
    async with asyncio.timeout(HANG_GUARD_S):
        chunks = engine.stream(_req(seed=5, text_stream=True), text=text)
        async with contextlib.aclosing(chunks):
            await anext(chunks)  # then no more reading
            await _until_load(server, lambda lo: lo.held == 1)
            before = text.tokens
            text.append("and then some more words, ")
            while text.tokens <= before:
                await asyncio.sleep(0.02)
            assert (await _load(server)).held == 1
    await _until_load(server, lambda lo: (lo.running, lo.held) == (0, 0))
