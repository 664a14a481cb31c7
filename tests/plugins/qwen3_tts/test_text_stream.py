"""The plugin's streaming-text path against the REAL engine (127.0.0.1, the tiny checkpoint whose
utterances end by EOS): `SynthesizeStream` sends the LLM's text as it comes over
`/v1/audio/speech/stream`, token-sized pieces, and the audio equals the engine's dual-track
synthesis of the whole text; an engine SIGKILLed mid-utterance, text still open, is failed over
to a second engine with the text replayed and the same seed, and the reply is the uncut one; an
engine that is full (`engine_full` on the socket) passes the segment to the next one at once.
Order is shown by events (audio received, a process killed), never by time.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from livekit.agents import APIConnectOptions
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES
from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from tests.support.engine_process import EngineProcess
from tests.support.tts_audio import pcm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
HANG_GUARD = 300.0
# Generous: two heavy tests may share 2 cores; max_retry 0 shows a failover is no LiveKit retry.
CONN = APIConnectOptions(timeout=120.0, max_retry=0)
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away."
# The chunked decoder's rounding: the same codes decoded in other chunks differ by this much at
# most (the engine's own equivalence tests use the same bound).
ROUNDING = 16


def _tokens(text: str) -> list[str]:
    """LLM-like pieces: 1 to 3 characters, splitting words."""
    sizes, out, i = [1, 3, 2], [], 0
    while i < len(text):
        n = sizes[len(out) % len(sizes)]
        out.append(text[i : i + n])
        i += n
    return out


def _tts(urls, seed: int | None = 7, **kw) -> qwen3_tts.TTS:
    kw = {"strategy": "priority", **kw}  # the tests say which engine speaks first
    return qwen3_tts.TTS(base_url=urls, voice="ryan", language="en", seed=seed,
                         timeout=httpx.Timeout(120.0), **kw)  # fmt: skip


async def _post_dual(url: str, text: str, seed: int, frames: int) -> np.ndarray:
    """The engine's dual-track synthesis of the whole text at once (POST), as int16."""
    body = {"model": "qwen3-tts", "input": text, "voice": "ryan", "language": "English",
            "seed": seed, "response_format": "pcm", "text_mode": "dual",
            "first_chunk_frames": frames}  # fmt: skip
    async with httpx.AsyncClient(timeout=HANG_GUARD) as c:
        r = await c.post(f"{url}/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, np.int16)


def _same_audio(audio: np.ndarray, reference: np.ndarray) -> None:
    assert len(audio) == len(reference) > 0
    assert np.abs(audio.astype(np.int32) - reference.astype(np.int32)).max() <= ROUNDING


async def _speak(
    tts, pieces: list[str], gate=None
) -> tuple[qwen3_tts.tts.SynthesizeStream, np.ndarray]:
    """Push `pieces` one by one; before the second half, wait for `gate()` (an awaitable
    that returns once something happened, e.g. audio played and an engine killed)."""
    stream = tts.stream(conn_options=CONN)
    audio: list[np.ndarray] = []
    heard = asyncio.Event()

    async def feed():
        half = len(pieces) // 2
        for i, piece in enumerate(pieces):
            if i == half and gate is not None:
                await gate(heard)
            stream.push_text(piece)
            await asyncio.sleep(0)  # each piece its own item on the stream's channel
        stream.end_input()

    feeder = asyncio.create_task(feed())
    try:
        async for ev in stream:
            data = pcm(ev)
            if data is not None and len(data):
                audio.append(data)
                if sum(len(a) for a in audio) >= FRAME_SAMPLES:
                    heard.set()
        await feeder
    finally:
        await stream.aclose()
        feeder.cancel()
    return stream, np.concatenate(audio) if audio else np.zeros(0, np.int16)


@pytest.mark.parametrize("frames", [1, 4])
async def test_tokens_streamed_to_a_real_engine_say_the_whole_text(engine, frames):
    """Token-sized pieces over the socket ("auto" reads the engine's status) == POST of the
    whole text, dual-track, same seed; first audio came while the text was still open."""
    url = f"http://127.0.0.1:{engine.port}"
    tts = _tts([url], first_chunk_frames=frames, first_clause_chunk_frames=None)
    try:
        stream, audio = await asyncio.wait_for(
            _speak(tts, _tokens(TEXT), gate=lambda heard: heard.wait()), HANG_GUARD
        )
    finally:
        await tts.aclose()
    assert stream.sentences == [] and len(stream.text_streams) == 1
    report = stream.text_streams[0]
    assert report.endpoints == [url] and report.text == TEXT and report.seed == 7
    assert report.first_chunk_frames == frames
    assert report.first_audio_before_end is True  # the second half was sent after audio came
    assert report.engine_first_audio_ms is not None and report.samples == len(audio)
    _same_audio(audio, await _post_dual(url, TEXT, 7, frames))
    # The comparison means something only if another seed says something else.
    other = await _post_dual(url, TEXT, 8, frames)
    assert not np.array_equal(other[: len(audio)], audio[: len(other)])


async def test_engine_killed_mid_utterance_fails_over_with_the_text_replayed(tiny_checkpoint):
    """Engine a is SIGKILLed after the first audio, with half the text sent; the segment moves
    to engine b with the text so far replayed and the same seed, the rest streamed there; the
    reply equals b's dual-track synthesis of the whole text (played bytes not played twice),
    within the one LiveKit attempt the stream's conn_options allow (max_retry=0)."""
    ckpt = tiny_checkpoint("custom_voice", eos="text")
    a, b = EngineProcess(ckpt), EngineProcess(ckpt)
    try:
        await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
        tts = _tts([a.url, b.url], seed=None, first_chunk_frames=2)  # the agent's: no seed
        killed: list[bool] = []

        async def kill_a(heard: asyncio.Event) -> None:
            await heard.wait()
            await asyncio.to_thread(a.kill)
            killed.append(True)

        try:
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(TEXT), kill_a), HANG_GUARD)
        finally:
            await tts.aclose()
        assert killed and stream.attempts == 1 and stream._conn_options is CONN
        report = stream.text_streams[0]
        assert report.endpoints == [a.url, b.url] and report.text == TEXT
        assert report.skipped_bytes > 0 and report.first_audio_before_end is True
        assert report.seed is not None and len(report.request_ids) == 2
        reference = await _post_dual(b.url, TEXT, report.seed, 2)
        _same_audio(audio, reference)
        other = await _post_dual(b.url, TEXT, report.seed + 1, 2)
        assert not np.array_equal(other[: len(audio)], audio[: len(other)])
    finally:
        a.stop(), b.stop()


async def test_a_full_engine_passes_the_streamed_segment_to_the_next_at_once(
    engine, tiny_checkpoint
):
    """Engine a is full for real (a queue of 0: it answers every request 429 `engine_full`; on
    the socket an `error` event with `retry_after_s`, after `session.created`). The segment goes
    to engine b within LiveKit's one attempt (max_retry=0: no LiveKit retry, as on the sentence
    path), a is passed over for its Retry-After and not marked down, and the reply is b's alone
    with the same seed."""
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    a = EngineServer(Engine(model, [Handler(model, max_queue=0, warmup=False)]),
                     ServerConfig(port=0, retry_after_s=7))  # fmt: skip
    await a.start()
    url_a, url_b = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{engine.port}"
    try:
        tts = _tts([url_a, url_b], first_chunk_frames=2)
        marked: list[float] = []
        mark_full = tts.endpoints.mark_full
        tts.endpoints.mark_full = lambda ep, after: (marked.append(after), mark_full(ep, after))
        try:
            stream, audio = await asyncio.wait_for(_speak(tts, _tokens(TEXT)), HANG_GUARD)
        finally:
            await tts.aclose()
    finally:
        await a.stop()
    assert stream.attempts == 1 and stream._conn_options is CONN
    report = stream.text_streams[0]
    assert report.endpoints == [url_a, url_b] and report.full == [url_a] and report.text == TEXT
    assert marked == [7.0]  # the engine's retry_after_s
    ep_a = tts.endpoints.endpoints[0]
    assert ep_a.healthy and ep_a.failures == 0 and ep_a.rejections == 1
    alone = _tts([url_b], first_chunk_frames=2)
    try:
        _, reference = await asyncio.wait_for(_speak(alone, _tokens(TEXT)), HANG_GUARD)
    finally:
        await alone.aclose()
    _same_audio(audio, reference)
    other = await _post_dual(url_b, TEXT, 8, 2)
    assert not np.array_equal(other[: len(audio)], audio[: len(other)])
