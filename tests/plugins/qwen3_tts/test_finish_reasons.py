"""Why each utterance ended, against the REAL engine (127.0.0.1, the tiny checkpoint whose
utterances end by EOS): a sentence capped by a small `max_new_tokens` ends as "length", on the
sentence path (POST: `X-Finish-Reason`, or from an engine that names none, the cap seen reached)
and over either socket dialect (`response.done`: `finish_reason`, or its `capped` flag;
vLLM-Omni's `audio.done` / `session.done`); an uncapped one as "stop". Each is logged (a warning for anything but "stop"), counted in
`TTS.finish_reasons` and emitted as the TTS's `"finish_reason"` event (what the agent exports).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from livekit.agents import APIConnectOptions
from livekit.plugins import qwen3_tts

from tests.support.tts_audio import stream_text

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fail_on_leaked_tasks")]
HANG_GUARD = 300.0
CONN = APIConnectOptions(timeout=120.0, max_retry=0)
LONG = "The quick brown fox jumps over the lazy dog, and then it runs far far away."


def _tts(url: str, text_input: str, max_new_tokens: int | None) -> qwen3_tts.TTS:
    protocol = "qwen3-tts"
    if text_input == "vllm-omni":  # the engine's vLLM-Omni dialect: audio.done / session.done
        protocol, text_input = "vllm-omni", "stream"
    return qwen3_tts.TTS(base_url=url, voice="ryan", language="en", seed=7, protocol=protocol,
                         text_input=text_input, max_new_tokens=max_new_tokens,
                         first_clause_min_words=None, timeout=httpx.Timeout(120.0))  # fmt: skip


async def _endings(tts: qwen3_tts.TTS, text: str) -> list[qwen3_tts.Ending]:
    endings: list[qwen3_tts.Ending] = []
    tts.on("finish_reason", endings.append)
    try:
        async with asyncio.timeout(HANG_GUARD):
            await stream_text(tts, [text], conn_options=CONN)
    finally:
        await tts.aclose()
    return endings


@pytest.mark.parametrize("text_input", ["sentences", "stream", "vllm-omni"])
async def test_a_capped_sentence_ends_as_length_and_is_warned_of(engine, text_input, caplog):
    url = f"http://127.0.0.1:{engine.port}"
    tts = _tts(url, text_input, max_new_tokens=2)
    with caplog.at_level(logging.WARNING, logger="livekit.plugins.qwen3_tts"):
        endings = await _endings(tts, LONG)
    assert [e.reason for e in endings] == ["length"] and tts.finish_reasons == {"length": 1}
    assert endings[0].endpoint == url
    assert sum("finish_reason=length" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("text_input", ["sentences", "stream", "vllm-omni"])
async def test_an_uncapped_sentence_ends_as_stop_without_a_warning(engine, text_input, caplog):
    tts = _tts(f"http://127.0.0.1:{engine.port}", text_input, max_new_tokens=None)
    with caplog.at_level(logging.WARNING, logger="livekit.plugins.qwen3_tts"):
        endings = await _endings(tts, "Hello there.")
    assert [e.reason for e in endings] == ["stop"]
    assert not [r for r in caplog.records if "finish_reason=" in r.getMessage()]


async def test_synthesize_reports_its_ending(engine):
    """`synthesize()` (one POST) reports the same way."""
    tts = _tts(f"http://127.0.0.1:{engine.port}", "sentences", max_new_tokens=2)
    endings: list[qwen3_tts.Ending] = []
    tts.on("finish_reason", endings.append)
    try:
        async with asyncio.timeout(HANG_GUARD):
            await tts.synthesize(LONG, conn_options=CONN).collect()
    finally:
        await tts.aclose()
    assert [e.reason for e in endings] == ["length"]


@pytest.mark.parametrize("text_input", ["stream", "vllm-omni"])
async def test_a_looping_utterance_ends_as_repetition(tiny_checkpoint, text_input, caplog):
    """The tiny checkpoint made to loop (its codes cycle, it never ends by itself): the engine's
    loop detector ends the utterance as "repetition", which the plugin warns of and counts."""
    from tests.support.speech_socket import engine_server

    model = str(tiny_checkpoint("custom_voice", eos="loop"))
    async with engine_server(model, 1) as server:
        tts = _tts(f"http://127.0.0.1:{server.port}", text_input, max_new_tokens=None)
        with caplog.at_level(logging.WARNING, logger="livekit.plugins.qwen3_tts"):
            endings = await _endings(tts, "Hello there.")
    assert [e.reason for e in endings] == ["repetition"]
    assert sum("finish_reason=repetition" in r.getMessage() for r in caplog.records) == 1
