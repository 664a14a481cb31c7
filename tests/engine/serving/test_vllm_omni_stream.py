"""vLLM-Omni's socket dialect at /v1/audio/speech/stream (an upgrade without the engine's
subprotocol), against the real engine on the tiny checkpoint: its messages and events as
vLLM-Omni words them (sticky config, input.done a flush, session.done per flush, sentence
indices), the config fields honoured or refused, `Api-Key` auth; and LiveKit's own client of the
dialect (`livekit.plugins.baseten.TTS(model="qwen3-tts")`, unchanged) speaking several turns on
one socket, a barge-in, and its keepalive. Order is shown by events, never by time."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from livekit.agents import APIConnectOptions
from livekit.plugins import baseten
from prometheus_client.parser import text_string_to_metric_families

from qwen3_tts_engine.protocol import SPEECH_STREAM_PATH
from tests.support.speech_socket import HANG_GUARD, client_session, engine_server, receive
from tests.support.tts_audio import pcm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
API_KEY = "omni-key"
CONFIG = {"type": "session.config", "voice": "ryan", "task_type": "CustomVoice",
          "language": "English", "response_format": "pcm", "stream_audio": True, "seed": 3}  # fmt: skip
CONN = APIConnectOptions(timeout=120.0, max_retry=0)


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(checkpoint, 2, api_key=API_KEY) as srv:  # the default heartbeat
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


def omni(session: aiohttp.ClientSession, scheme: str = "Api-Key", key: str = API_KEY):
    return session.ws_connect(SPEECH_STREAM_PATH, headers={"Authorization": f"{scheme} {key}"},
                              timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD))  # fmt: skip


async def until(ws, kind: str) -> list:
    """Events and audio up to (and with) the first event of `kind` (or an error, or the close)."""
    out = []
    while True:
        m = await receive(ws)
        out.append(m)
        if isinstance(m, aiohttp.WSMessage) or (
            isinstance(m, dict) and m["type"] in (kind, "error")
        ):
            return out


def kinds(events: list) -> list[str]:
    return ["<pcm>" if isinstance(e, bytes) else e["type"] for e in events if not isinstance(e, aiohttp.WSMessage)]  # fmt: skip


async def connections(session) -> int:
    text = await (await session.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        if family.name == "qwen3_tts_socket_connections":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")
                           and s.labels.get("protocol") == "vllm_omni"))  # fmt: skip
    return 0


async def test_flushes_on_one_socket_as_vllm_omni_words_them(server, session):
    async with omni(session) as ws:
        assert ws.protocol is None
        await ws.send_json(CONFIG)
        for piece in ("Hello ", "there, ", "friend."):
            await ws.send_json({"type": "input.text", "text": piece})
        await ws.send_json({"type": "input.done"})
        first = await until(ws, "session.done")
        assert kinds(first)[0] == "audio.start" and kinds(first)[-2:] == [
            "audio.done",
            "session.done",
        ]
        start, done, flushed = first[0], first[-2], first[-1]
        assert start["utterance_index"] == 0 and start["sentence_index"] == 0
        assert start["format"] == "pcm" and start["sample_rate"] == 24000
        audio = b"".join(m for m in first if isinstance(m, bytes))
        assert len(audio) > 0 and done["total_bytes"] == len(audio) and done["error"] is False
        assert done["finish_reason"] == "stop"
        assert flushed == {"type": "session.done", "utterance_index": 0, "total_sentences": 1,
                           "finish_reason": "stop"}  # fmt: skip
        # an empty flush (LiveKit's keepalive): session.done with zero sentences, at once
        await ws.send_json({"type": "input.done"})
        assert await until(ws, "session.done") == [
            {"type": "session.done", "utterance_index": 1, "total_sentences": 0, "finish_reason": "stop"}
        ]  # fmt: skip
        # the config is sticky; sentence splitting: one synthesis per sentence, in order
        await ws.send_json({"type": "session.config", **{k: v for k, v in CONFIG.items() if k != "type"},
                            "split_granularity": "sentence"})  # fmt: skip
        await ws.send_json({"type": "input.text", "text": "One two. Three"})
        await ws.send_json({"type": "input.text", "text": " four."})
        await ws.send_json({"type": "input.done"})
        events = [e for e in await until(ws, "session.done") if isinstance(e, dict)]
        starts = [e for e in events if e["type"] == "audio.start"]
        assert [(e["utterance_index"], e["sentence_index"]) for e in starts] == [(2, 0), (2, 1)]
        assert [e["sentence_text"] for e in starts][0] == "One two."
        assert events[-1]["total_sentences"] == 2
        await ws.send_json({"type": "session.close"})
        closed = await receive(ws)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000


async def test_whole_sentences_in_a_format_and_capped_ones_say_length(server, session):
    async with omni(session, "Bearer") as ws:  # either scheme
        await ws.send_json({**CONFIG, "response_format": "wav", "stream_audio": False,
                            "max_new_tokens": 3})  # fmt: skip
        await ws.send_json({"type": "input.text", "text": "A rather long sentence to cut short."})
        await ws.send_json({"type": "input.done"})
        events = await until(ws, "session.done")
        assert kinds(events) == ["audio.start", "<pcm>", "audio.done", "session.done"]
        assert events[1][:4] == b"RIFF" and events[2]["total_bytes"] == len(events[1])
        assert events[2]["finish_reason"] == "length" and events[3]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("config", "param"),
    [({"stream_audio": True, "response_format": "wav"}, "response_format"),
     ({"word_timestamps": True}, "word_timestamps"), ({"split_granularity": "word"}, "split_granularity"),
     ({"speed": 1.5}, "speed"), ({"voice": "nobody"}, "voice")],
)  # fmt: skip
async def test_a_config_this_engine_cannot_honour_is_refused(server, session, config, param):
    async with omni(session) as ws:
        await ws.send_json({**CONFIG, **config})
        [error, closed] = await until(ws, "error") + [await receive(ws)]
        assert error["type"] == "error" and error["status"] == 400 and error["param"] == param
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1008


async def test_text_before_config_or_a_config_mid_utterance_is_an_error(server, session):
    async with omni(session) as ws:
        await ws.send_json({"type": "input.text", "text": "Hi."})
        [error] = await until(ws, "error")
        assert error["message"] == "Expected session.config, got: input.text"
    async with omni(session) as ws:
        await ws.send_json(CONFIG)
        await ws.send_json({"type": "input.text", "text": "Hi"})
        await ws.send_json(CONFIG)
        events = await until(ws, "error")
        assert "send input.done first" in events[-1]["message"]


async def test_the_wrong_key_is_refused_in_either_scheme(server, session):
    for scheme in ("Api-Key", "Bearer"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await omni(session, scheme, "wrong")
        assert e.value.status == 401


# -- LiveKit's client of the dialect, unchanged --------------------------------------------------


def _baseten(server, http: aiohttp.ClientSession) -> baseten.TTS:
    return baseten.TTS(model="qwen3-tts", model_endpoint=f"ws://127.0.0.1:{server.port}{SPEECH_STREAM_PATH}",
                       api_key=API_KEY, voice="ryan", task_type="CustomVoice", language="English",
                       http_session=http)  # fmt: skip


async def _turn(tts, text: str, stop_after_audio: bool = False) -> np.ndarray:
    stream = tts.stream(conn_options=CONN)
    audio: list[np.ndarray] = []
    for word in text.split(" "):
        stream.push_text(word + " ")
    if not stop_after_audio:
        stream.end_input()
    try:
        async with asyncio.timeout(HANG_GUARD):
            async for ev in stream:
                if (data := pcm(ev)) is not None and len(data):
                    audio.append(data)
                    if stop_after_audio:
                        break  # the caller barges in: the text is still open
    finally:
        await stream.aclose()
    return np.concatenate(audio) if audio else np.zeros(0, np.int16)


async def test_livekit_baseten_speaks_turns_on_one_socket_barges_in_and_keeps_alive(
    server, session
):
    before = await connections(session)
    async with aiohttp.ClientSession() as http:
        tts = _baseten(server, http)
        try:
            for text in ("Hello there, how are you?", "I can help with that.", "Goodbye for now."):
                assert len(await _turn(tts, text)) > 0
            assert await connections(session) == before + 1  # three turns, one connection
            # its keepalive: an empty input.done on the parked socket answers session.done
            warm = tts._qwen3._warm
            assert warm is not None and await tts._qwen3._empty_flush(warm.ws) is True
            # a barge-in: the stream closed after its first audio; LiveKit discards that socket
            assert len(await _turn(tts, "This reply is cut short by the caller who", True)) > 0
            async with asyncio.timeout(HANG_GUARD):
                while (load := await (await session.get("/load")).json())["sessions"] or load[
                    "running"
                ]:
                    await asyncio.sleep(0.05)  # the engine cancelled it: no socket, no stream
            assert len(await _turn(tts, "And the next reply is whole.")) > 0
            assert await connections(session) == before + 2
        finally:
            await tts.aclose()
