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

from .engine_process import EngineProcess, free_port

pytestmark = pytest.mark.slow
FRAMES = 6  # a cap: checkpoints that never emit EOS give every sentence exactly 6
SENTENCES = ["The first sentence is here.", "Then comes the second one.", "And the third one ends it."]


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
    kw.setdefault("max_new_tokens", FRAMES)
    return qwen3_tts.TTS(base_url=urls, probe_interval=0.3, **kw)


async def _stream_text(tts: qwen3_tts.TTS, pieces: list[str], *, on_audio=None):
    """Push text like an LLM does (word by word), collect the audio as int16."""
    stream = tts.stream()
    audio = []

    async def feed():
        for sentence in pieces:
            for word in sentence.split(" "):
                stream.push_text(word + " ")
                await asyncio.sleep(0.005)
        stream.end_input()

    feeder = asyncio.create_task(feed())
    async for ev in stream:
        audio.append(np.frombuffer(bytes(ev.frame.data), dtype=np.int16))
        if on_audio is not None:
            await on_audio(stream, sum(len(a) for a in audio))
    await feeder
    return stream, np.concatenate(audio) if audio else np.zeros(0, np.int16)


async def _sentence_audio(tts: qwen3_tts.TTS, text: str) -> np.ndarray:
    frames = [np.frombuffer(bytes(ev.frame.data), dtype=np.int16) async for ev in tts.synthesize(text)]
    return np.concatenate(frames)


async def test_three_sentences_stream_in_order_with_ttfb(engines):
    import httpx

    a, _ = engines
    tts = _tts([a.url], max_new_tokens=None)  # each sentence ends by EOS
    metrics = []
    tts.on("metrics_collected", metrics.append)
    try:
        stream, audio = await _stream_text(tts, SENTENCES)
        assert [s.text for s in stream.sentences] == SENTENCES
        # Each sentence is whole frames, ended by EOS at its own length, never by the cap.
        async with httpx.AsyncClient(base_url=a.url) as c:
            handler = (await c.get("/v1/engine/status")).json()["handlers"][0]
        assert handler["last_stats"] and not handler["last_stats"]["hit_token_cap"]
        samples = [s.samples for s in stream.sentences]
        assert all(n > 0 and n % FRAME_SAMPLES == 0 for n in samples), samples
        assert len(set(samples)) > 1, samples  # different sentences end at different frames
        assert len(audio) == sum(samples)  # no silence or marker frames between or after them
        # Text order = audio order: the stream equals the three sentences synthesized one by one.
        reference = np.concatenate([await _sentence_audio(tts, s) for s in SENTENCES])
        assert audio.shape == reference.shape
        np.testing.assert_array_equal(audio, reference)
    finally:
        await tts.aclose()
    m = [x for x in metrics if getattr(x, "ttfb", -1) > 0]
    assert m, metrics
    assert 0 < m[0].ttfb < m[0].duration


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
        for _ in range(300):
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


async def test_failover_mid_utterance_loses_and_repeats_nothing(tiny_checkpoint):
    ckpt = tiny_checkpoint("custom_voice")
    a, b = EngineProcess(ckpt).start(), EngineProcess(ckpt).start()
    frames = 12
    tts = _tts([a.url, b.url], max_new_tokens=frames)
    try:
        killed = {}

        async def kill_a_mid_sentence(stream, samples):
            if not killed and samples >= FRAME_SAMPLES:  # first sentence is playing, from a
                killed["samples"] = samples
                await asyncio.to_thread(a.kill)

        stream, audio = await _stream_text(tts, SENTENCES, on_audio=kill_a_mid_sentence)
        assert killed
        reports = stream.sentences
        assert [r.samples for r in reports] == [frames * FRAME_SAMPLES] * 3  # each heard once
        assert reports[0].endpoints == [a.url, b.url] and reports[0].skipped_bytes > 0
        # Sentence 2 may have been prefetched on a (queued behind sentence 1) before a died.
        assert reports[1].endpoints in ([b.url], [a.url, b.url])
        assert reports[2].endpoints == [b.url]
        assert len(audio) == 3 * frames * FRAME_SAMPLES
        # Same seed and checkpoint on both engines: the finished audio equals an uncut run.
        reference = np.concatenate([await _sentence_audio(tts, s) for s in SENTENCES])
        np.testing.assert_array_equal(audio, reference)

        # a is not retried while down...
        pool = tts.endpoints
        ep_a = pool.endpoints[0]
        assert not ep_a.healthy
        before = ep_a.requests
        await _sentence_audio(tts, "Still on b.")
        assert ep_a.requests == before
        # ...and is used again once it is back (same port).
        a.start()
        for _ in range(100):
            if ep_a.healthy:
                break
            await asyncio.sleep(0.1)
        assert ep_a.healthy
        await _sentence_audio(tts, "Back on a.")
        assert ep_a.requests == before + 1
    finally:
        await tts.aclose()
        a.stop(), b.stop()


async def test_errors_map_to_livekit_exceptions(engines):
    a, _ = engines
    tts = _tts([a.url], voice="nobody")
    with pytest.raises(APIStatusError) as e:
        await _sentence_audio(tts, "Hello.")
    assert e.value.status_code == 400 and not e.value.retryable
    await tts.aclose()
    dead = _tts([f"http://127.0.0.1:{free_port()}"])
    with pytest.raises(APIConnectionError):
        await _sentence_audio(dead, "Hello.")
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
        audio = await _sentence_audio(tts, "Hello from vLLM.")
    finally:
        await tts.aclose()
        await runner.cleanup()
    assert len(audio) == 4800
    assert seen == [{
        "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "input": "Hello from vLLM.",
        "voice": "vivian", "response_format": "pcm", "stream": True, "language": "English",
        "task_type": "CustomVoice", "instructions": "Speak warmly.", "max_new_tokens": 300,
    }], json.dumps(seen)
