"""The LiveKit Qwen3-TTS plugin against real engine servers (subprocesses on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web
from livekit.agents import APIConnectionError, APIStatusError
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES
from tests.support.engine_process import EngineProcess, free_port
from tests.support.tts_audio import stream_text, synthesize

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
FRAMES = 6  # a cap: checkpoints that never emit EOS give every sentence exactly 6
SENTENCES = [
    "The first sentence is here.",
    "Then comes the second one.",
    "And the third one ends it.",
]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    ckpt = tiny_checkpoint("custom_voice", eos="text")  # utterances end by EOS, as real ones do
    a, b = EngineProcess(ckpt), EngineProcess(ckpt)
    a.start(), b.start()
    yield a, b
    a.stop(), b.stop()


def _tts(urls, **kw) -> qwen3_tts.TTS:
    kw.setdefault("voice", "ryan")
    kw.setdefault("language", "en")
    kw.setdefault("seed", 11)
    # the sentence path (these engines take streamed text too: test_text_stream.py)
    kw.setdefault("text_input", "sentences")
    # every request's first chunk as synthesize()'s: the same chunking, so the same int16 rounding
    kw.setdefault("first_clause_chunk_frames", None)
    kw.setdefault("max_new_tokens", FRAMES)
    return qwen3_tts.TTS(base_url=urls, probe_interval=0.3, **kw)


async def test_three_sentences_stream_in_order_with_ttfb(engines):
    import httpx

    a, _ = engines
    tts = _tts([a.url], max_new_tokens=None)  # each sentence ends by EOS
    metrics = []
    tts.on("metrics_collected", metrics.append)
    try:
        stream, audio = await stream_text(tts, SENTENCES)
        assert [s.text for s in stream.sentences] == SENTENCES
        # Each sentence is whole frames, ended by EOS at its own length, never by the cap.
        async with httpx.AsyncClient(base_url=a.url) as c:
            handler = (await c.get("/v1/engine/status")).json()["handlers"][0]
        assert handler["last_stats"] and not handler["last_stats"]["hit_token_cap"]
        # `serve`'s default compute dtype (auto) as the worker resolved it: float32 on a CPU
        from qwen3_tts_engine.worker.cpu_kernels import on_cpu

        assert handler["info"]["compute_dtype"] == ("float32" if on_cpu() else None)
        samples = [s.samples for s in stream.sentences]
        assert all(n > 0 and n % FRAME_SAMPLES == 0 for n in samples), samples
        assert len(set(samples)) > 1, samples  # different sentences end at different frames
        assert len(audio) == sum(samples)  # no silence or marker frames between or after them
        # Text order = audio order: the stream equals the three sentences synthesized one by one.
        reference = np.concatenate([await synthesize(tts, s) for s in SENTENCES])
        assert audio.shape == reference.shape
        np.testing.assert_array_equal(audio, reference)
    finally:
        await tts.aclose()
    m = [x for x in metrics if getattr(x, "ttfb", -1) > 0]
    assert m, metrics
    assert 0 < m[0].ttfb < m[0].duration


@pytest.mark.parametrize("text_input", ["sentences", "stream"])
async def test_text_with_nothing_to_say_is_not_sent(engines, text_input):
    """A sentence of zero-width and control characters alone (an LLM may end a reply with one) is
    refused by the engine (400): the plugin does not send it, and the reply is not failed after
    its first sentence played (g22: "TTS failed after partial audio was already sent")."""
    from livekit.plugins.qwen3_tts.protocol import has_speakable_text
    from qwen3_tts_engine.protocol import has_speakable_text as engine_rule

    nothing = "\u200b\u2060\ufeff\x07"
    for text in (nothing, " \n", "", ".", "a", "\u00e9", "\u200bhi"):
        assert has_speakable_text(text) == engine_rule(text), repr(text)  # the engine's rule
    a, _ = engines
    tts = _tts([a.url], text_input=text_input)
    try:
        # the reply's first clause is a request of its own; what follows it is the nothing
        stream, audio = await stream_text(tts, ["Hello there, you,", nothing])
        assert len(audio) > 0
        said = [s.text for s in stream.sentences] + [r.text for r in stream.text_streams]
        assert any("Hello there, you," in t for t in said) and all(
            has_speakable_text(t) for t in said
        ), said
    finally:
        await tts.aclose()


async def test_closing_the_stream_cancels_server_work(engines):
    import httpx

    a, _ = engines
    tts = _tts([a.url], max_new_tokens=400, first_chunk_frames=1)
    stream = tts.stream()
    stream.push_text("This is a very long sentence that the user interrupts. ")
    stream.end_input()
    async for _ in stream:
        break  # first audio arrived: the user barges in
    await stream.aclose()
    await tts.aclose()
    async with httpx.AsyncClient(base_url=a.url) as c:
        async with asyncio.timeout(120):  # a hang guard: the engine ends the cancelled request
            while True:
                status = (await c.get("/v1/engine/status")).json()
                handler = status["handlers"][0]
                if handler["queue_depth"] == 0 and handler["last_stats"]:
                    break
                await asyncio.sleep(0.1)
    stats = handler["last_stats"]
    assert stats["cancelled"]
    # The client's first audio frame needs 200 ms (3 codec frames) of audio, so the engine had
    # made at most the 1-frame first chunk and two 4-frame chunks; it stops within one more.
    assert stats["frames"] <= 1 + 4 + 4 + 4, stats


async def test_errors_map_to_livekit_exceptions(engines):
    a, _ = engines
    tts = _tts([a.url], voice="nobody")
    with pytest.raises(APIStatusError) as e:
        await synthesize(tts, "Hello.")
    assert e.value.status_code == 400 and not e.value.retryable
    await tts.aclose()
    dead = _tts([f"http://127.0.0.1:{free_port()}"])
    with pytest.raises(APIConnectionError):
        await synthesize(dead, "Hello.")
    await dead.aclose()


async def test_vllm_omni_fields_sent_exactly():
    """A loopback server that speaks the protocol (200, chunked audio/pcm) records the JSON."""
    seen: list[dict] = []

    async def speech(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await resp.prepare(request)
        await resp.write(b"\x01\x00" * 4800)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tts = qwen3_tts.TTS(
        base_url=f"http://127.0.0.1:{port}", protocol="vllm-omni",
        model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", voice="vivian", language="en",
        task_type="custom_voice", instructions="Speak warmly.", max_new_tokens=300,
        ref_audio=None, seed=3, temperature=0.5, variant="4bit",
    )  # fmt: skip
    try:
        audio = await synthesize(tts, "Hello from vLLM.")
    finally:
        await tts.aclose()
        await runner.cleanup()
    assert len(audio) == 4800
    assert seen == [
        {
            "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
            "input": "Hello from vLLM.",
            "voice": "vivian",
            "response_format": "pcm",
            "stream": True,
            "language": "English",
            "task_type": "CustomVoice",
            "instructions": "Speak warmly.",
            "max_new_tokens": 300,
        }
    ], json.dumps(seen)
