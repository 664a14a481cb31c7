"""The default frame cap (`protocol.default_max_new_tokens`) and the flag of an utterance that ran
to it: `X-Qwen3-TTS-Capped` on a whole POST response, `"capped"` in the SSE `speech.audio.done`
and in the socket's `response.done`, and `qwen3_tts_utterances_capped_total` in /metrics.

The tiny checkpoint `custom_voice` never samples end-of-speech (its EOS row is zeroed), so each
of its utterances runs to the cap and its frames are the formula's value; the `engine` fixture's
(`eos="text"`) ends by EOS, with no flag. Frame counts, never time."""

from __future__ import annotations

import base64
import json
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    HEADER_CAPPED,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    Limits,
    default_max_new_tokens,
    slow_speech,
    speech_chars,
)
from qwen3_tts_engine.sentences import split_input
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

HANG_GUARD = 120
TEXT = "Hello there."
SLOW = "Speak slowly, in a sad voice."
BODY = {"voice": "ryan", "language": "english", "seed": 3, "response_format": "pcm"}
CAPPED = "qwen3_tts_utterances_capped_total"


# -- the formula ------------------------------------------------------------------------------


def test_the_default_cap_is_the_text_at_the_slowest_rate_plus_slack():
    # 5 characters a second at 12.5 frames a second: 2.5 frames per character, + 40 frames
    assert default_max_new_tokens("") == 40
    assert default_max_new_tokens(TEXT) == math.ceil(12 * 2.5) + 40 == 70
    assert default_max_new_tokens("x" * 100000) == Limits.max_new_tokens


def test_slow_or_emotional_instructions_double_the_time():
    assert slow_speech(SLOW) and slow_speech("WHISPER it") and slow_speech("用悲伤的语气")
    assert not slow_speech("Cheerful and fast") and not slow_speech(None) and not slow_speech("")
    assert default_max_new_tokens(TEXT, SLOW) == 12 * 5 + 40
    assert default_max_new_tokens(TEXT, "Cheerful") == default_max_new_tokens(TEXT)
    assert default_max_new_tokens("x" * 1000, SLOW) == Limits.max_new_tokens  # never above it


def test_a_cjk_character_counts_as_two():
    assert speech_chars("你好，世界。") == 4 * 2 + 2  # 4 Han characters, 2 punctuation marks
    assert speech_chars("こんにちは") == speech_chars("안녕하세요") == 10
    assert default_max_new_tokens("你好。") == math.ceil(5 * 2.5) + 40


# -- the engine: capped utterances (a checkpoint that never ends by itself) ---------------------


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice"))  # EOS never sampled: runs to the cap
    srv = EngineServer(Engine(checkpoint, [Handler(checkpoint, max_batch=2)]), ServerConfig(port=0))
    await srv.start()
    yield srv
    await srv.stop()


def _client(srv) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=HANG_GUARD)


async def _capped_count(srv) -> float:
    async with _client(srv) as c:
        text = (await c.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == CAPPED)  # fmt: skip


async def _post(srv, **body) -> httpx.Response:
    async with _client(srv) as c:
        r = await c.post("/v1/audio/speech", json={**BODY, **body})
    assert r.status_code == 200, r.text
    return r


async def _sse_done(srv, **body) -> tuple[int, dict]:
    """Samples and the `speech.audio.done` event of an SSE response."""
    events = []
    async with _client(srv) as c, c.stream("POST", "/v1/audio/speech",
                                           json={**BODY, "stream_format": "sse", **body}) as r:  # fmt: skip
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    samples = sum(len(base64.b64decode(e["audio"])) // 2 for e in events[:-1])
    assert events[-1]["type"] == "speech.audio.done"
    return samples, events[-1]


async def _socket_done(srv, pieces: list[str], **start) -> dict:
    """The `response.done` of a socket utterance whose text comes in `pieces`."""
    import aiohttp

    async with (
        aiohttp.ClientSession(f"http://127.0.0.1:{srv.port}") as s,
        s.ws_connect(SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,)) as ws,
    ):
        await ws.send_json({"type": "session.start", "voice": "ryan", "language": "en", "seed": 3,
                            **start})  # fmt: skip
        for piece in pieces:
            await ws.send_json({"type": "input_text.append", "text": piece})
        await ws.send_json({"type": "input_text.end"})
        last = None
        while (m := await ws.receive(timeout=HANG_GUARD)).type == aiohttp.WSMsgType.TEXT or (
            m.type == aiohttp.WSMsgType.BINARY
        ):
            if m.type == aiohttp.WSMsgType.TEXT:
                last = json.loads(m.data)
                assert last["type"] != "error", last
                if last["type"] == "response.done":
                    break  # the socket stays open for another utterance
    assert last is not None and last["type"] == "response.done"
    return last


@pytest.mark.slow
async def test_post_runs_to_the_default_cap_and_says_so(server):
    before = await _capped_count(server)
    r = await _post(server, input=TEXT)
    assert len(r.content) == default_max_new_tokens(TEXT) * FRAME_SAMPLES * 2
    assert r.headers[HEADER_CAPPED] == "true"
    # slow, sad speech gets twice the time
    r = await _post(server, input=TEXT, instructions=SLOW)
    assert len(r.content) == default_max_new_tokens(TEXT, SLOW) * FRAME_SAMPLES * 2 == 100 * 3840
    assert r.headers[HEADER_CAPPED] == "true"
    assert await _capped_count(server) == before + 2  # counted before the response is sent


@pytest.mark.slow
async def test_each_sentence_of_a_post_has_its_own_cap(server):
    text = "The first sentence is right here. And then a second one."
    sentences = split_input(text)
    assert len(sentences) == 2
    r = await _post(server, input=text)
    expected = sum(default_max_new_tokens(s) for s in sentences)
    assert (
        len(r.content)
        == expected * FRAME_SAMPLES * 2
        != default_max_new_tokens(text) * FRAME_SAMPLES * 2
    )
    assert r.headers[HEADER_CAPPED] == "true"


@pytest.mark.slow
async def test_a_streamed_post_says_so_in_its_sse_done_event(server):
    samples, done = await _sse_done(server, input=TEXT)
    assert samples == default_max_new_tokens(TEXT) * FRAME_SAMPLES
    assert done["capped"] is True


@pytest.mark.slow
async def test_streamed_text_is_capped_by_all_of_its_text_once_it_has_ended(server):
    """The cap follows the text as it grows: the whole text's, not the first piece's."""
    pieces = ["Hi there, ", "my friend."]
    whole = "".join(pieces)
    before = await _capped_count(server)
    done = await _socket_done(server, pieces)
    assert done["frames"] == default_max_new_tokens(whole) > default_max_new_tokens(pieces[0])
    assert done["samples"] == done["frames"] * FRAME_SAMPLES
    assert done["capped"] is True
    done = await _socket_done(server, pieces, instructions="Whisper it, slowly.")
    assert done["frames"] == default_max_new_tokens(whole, "Whisper it, slowly.")
    assert done["capped"] is True
    assert await _capped_count(server) == before + 2  # counted before response.done is sent


@pytest.mark.slow
async def test_a_request_cap_is_a_cap_too(server):
    r = await _post(server, input=TEXT, max_new_tokens=6)
    assert len(r.content) == 6 * FRAME_SAMPLES * 2 and r.headers[HEADER_CAPPED] == "true"


# -- an utterance that ends by EOS has no flag ----------------------------------------------------


@pytest.mark.slow
async def test_an_utterance_ended_by_eos_is_not_flagged(engine):
    before = await _capped_count(engine)
    r = await _post(engine, input=TEXT)
    assert 0 < len(r.content) < default_max_new_tokens(TEXT) * FRAME_SAMPLES * 2
    assert HEADER_CAPPED not in r.headers
    samples, done = await _sse_done(engine, input=TEXT)
    assert 0 < samples < default_max_new_tokens(TEXT) * FRAME_SAMPLES and done["capped"] is False
    done = await _socket_done(engine, ["Hello ", "there."])
    assert 0 < done["frames"] < default_max_new_tokens(TEXT) and done["capped"] is False
    assert await _capped_count(engine) == before
