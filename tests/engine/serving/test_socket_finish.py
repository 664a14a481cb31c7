"""Finish reasons on every socket dialect (protocol.FINISH_REASONS): an utterance that runs to its
frame cap (the tiny checkpoint that never says end-of-speech) says `length` in its done event, a
cancelled one `abort`: ours in `response.done`, the hosted protocol in `response.done`'s
`status_details`, vLLM-Omni's in `audio.done` and `session.done`."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.speech_socket import (
    DIALECTS,
    PATIENT_SOCKETS,
    client_session,
    engine_server,
    receive,
)

pytestmark = pytest.mark.slow
API_KEY = "finish-key"
ALL = pytest.mark.parametrize("dialect", DIALECTS.values(), ids=list(DIALECTS))
FLUSH = {"speech_stream": {"type": "input_text.end"},
         "qwen_realtime": {"type": "input_text_buffer.commit"}, "vllm_omni": {"type": "input.done"}}  # fmt: skip
CANCEL = {"speech_stream": {"type": "response.cancel"}, "qwen_realtime": {"type": "response.cancel"},
          "vllm_omni": {"type": "session.close"}}  # fmt: skip


def finish_reason(dialect: str, event: dict) -> str | None:
    """The finish reason of a done event of `dialect`, else None."""
    kind = event.get("type")
    if dialect == "qwen_realtime" and kind == "response.done":
        return event["response"]["status_details"]["finish_reason"]
    if (dialect, kind) in (("speech_stream", "response.done"), ("vllm_omni", "audio.done")):
        return event["finish_reason"]
    return None


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice"))  # never ends by itself: its frame cap
    async with engine_server(checkpoint, 2, api_key=API_KEY, **PATIENT_SOCKETS) as srv:
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


async def _reason(ws, dialect) -> tuple[str, list]:
    seen = []
    while not isinstance(m := await receive(ws), aiohttp.WSMessage):
        if isinstance(m, dict):
            assert m["type"] != "error", m
            seen.append(m)
            if (reason := finish_reason(dialect.name, m)) is not None:
                return reason, seen
    raise AssertionError(f"closed without a done event: {m}")


@ALL
async def test_a_capped_utterance_says_length(server, session, dialect):
    async with dialect.connect(session, API_KEY) as ws:
        await dialect.open_text(ws, "Hi.")
        await ws.send_json(FLUSH[dialect.name])
        reason, seen = await _reason(ws, dialect)
        assert reason == "length"
        if dialect.name == "vllm_omni":
            done = await receive(ws)
            assert done["type"] == "session.done" and done["finish_reason"] == "length"
        if dialect.name == "qwen_realtime":
            assert seen[-1]["response"]["status"] == "incomplete"


@ALL
async def test_a_cancelled_utterance_says_abort(server, session, dialect):
    async with dialect.connect(session, API_KEY) as ws:
        await dialect.open_text(ws, "Hello there, and then")
        while not isinstance(m := await receive(ws), bytes) and not (
            isinstance(m, dict) and m.get("type") == "response.audio.delta"
        ):
            assert not isinstance(m, aiohttp.WSMessage), m  # until its first audio
        await ws.send_json(CANCEL[dialect.name])
        reason, seen = await _reason(ws, dialect)
        assert reason == "abort"
        if dialect.name == "qwen_realtime":
            assert seen[-1]["response"]["status"] == "cancelled"
