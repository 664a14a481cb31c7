"""A variant swap while a streamed-text socket is open (real handlers on tiny checkpoints, real
WebSocket on 127.0.0.1): the swap waits for the open utterance instead of cutting it, and the
next socket is served by the new variant. Order is shown by the engine's state, not by time."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from qwen3_tts_engine.governor.memory import ManualProbe
from qwen3_tts_engine.governor.policy import Policy
from qwen3_tts_engine.protocol import SPEECH_STREAM_PATH, SPEECH_STREAM_SUBPROTOCOL
from tests.engine.governor.test_swap import AUTH, GB, LADDER, start_server, wait_for_swap
from tests.support.speech_socket import until_done

pytestmark = pytest.mark.slow
HANG_GUARD = 120
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}


async def _until(predicate) -> None:
    for _ in range(HANG_GUARD * 20):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not get there")


async def _server(tiny_checkpoint):
    model = tiny_checkpoint("custom_voice", eos="text")
    probe = ManualProbe(limit_bytes=8 * GB, pressure=0.1)
    policy = Policy(LADDER, downgrade_at=0.8, upgrade_at=0.05, downgrade_hold_s=0.2, cooldown_s=5.0,
                    critical_at=0.99)  # fmt: skip
    return await start_server(model, probe, policy, max_batch=2)


async def _speak_until_audio(ws, text: str) -> list:
    """Start, append `text` and read up to the first audio: the events before it."""
    await ws.send_json(START)
    await ws.send_json({"type": "input_text.append", "text": text})
    heard = []
    while (m := await asyncio.wait_for(ws.receive(), HANG_GUARD)).type != aiohttp.WSMsgType.BINARY:
        assert m.type == aiohttp.WSMsgType.TEXT
        heard.append(json.loads(m.data))
    return heard


async def test_a_swap_waits_for_an_open_text_stream(tiny_checkpoint):
    server = await _server(tiny_checkpoint)
    try:
        old = server.engine.active
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession(url, headers=AUTH) as s:
            ws = await s.ws_connect(SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,))
            heard = await _speak_until_audio(ws, "Hello there, ")
            swap = asyncio.create_task(s.post("/v1/engine/variant",
                                              json={"variant": "8bit", "mode": "make-before-break"}))  # fmt: skip
            # the new variant serves while the old handler drains; the open stream is still on it
            await _until(lambda: server.engine.active.variant == "8bit")
            assert old.in_flight == 1 and old.state == "draining"  # not cut: still speaking
            await ws.send_json({"type": "input_text.append", "text": "how are you today?"})
            await ws.send_json({"type": "input_text.end"})
            heard += await until_done(ws)
            await ws.close()
            response = await asyncio.wait_for(swap, HANG_GUARD)
            assert response.status == 200, await response.text()
            rec = await wait_for_swap(server.governor, 1)
            async with s.ws_connect(
                SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,)
            ) as after:
                await after.send_json({**START, "input": "And now?"})
                await after.send_json({"type": "input_text.end"})
                later = await until_done(after)
        assert heard[0]["type"] == "session.created" and heard[0]["variant"] == "bf16"
        assert heard[-1]["type"] == "response.done" and heard[-1]["frames"] > 0
        assert not [e for e in heard if isinstance(e, dict) and e["type"] == "error"]
        assert rec.cut == 0 and (rec.from_variant, rec.to_variant) == ("bf16", "8bit")
        assert later[0]["variant"] == "8bit" and later[-1]["type"] == "response.done"
    finally:
        await server.stop()


async def test_text_sent_during_a_swap_gap_is_spoken_whole_by_the_new_variant(
    tiny_checkpoint, checkpoint_tokens
):
    """Break before make: a socket that starts while no handler serves waits (held, not
    refused), its text pieces kept; the new handler gets all of it and speaks it whole."""
    server = await _server(tiny_checkpoint)
    engine = server.engine
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}", headers=AUTH) as s:
            first = await s.ws_connect(SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,))
            await _speak_until_audio(first, "Hello there, ")  # holds the old handler open
            swap = asyncio.create_task(s.post("/v1/engine/variant",
                                              json={"variant": "8bit", "mode": "break-before-make"}))  # fmt: skip
            await _until(lambda: not engine.serving)
            held = await s.ws_connect(SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,))
            await held.send_json(START)
            await held.send_json(
                {"type": "input_text.append", "text": "Spoken "}
            )  # its stream begins
            await _until(lambda: engine.gap_waiting == 1)
            for piece in ("after the ", "swap, whole."):
                await held.send_json({"type": "input_text.append", "text": piece})
            await held.send_json({"type": "input_text.end"})
            await first.send_json({"type": "input_text.end"})  # the old handler can drain now
            old_events = await until_done(first)
            events = await until_done(held)
            await first.close()
            await held.close()
            assert (await asyncio.wait_for(swap, HANG_GUARD)).status == 200
        assert old_events[-1]["type"] == "response.done" and old_events[-1]["variant"] == "bf16"
        assert events[-1]["variant"] == "8bit"
        assert events[0]["type"] == "session.created" and events[-1]["type"] == "response.done"
        assert engine.active.variant == "8bit" and engine.active.history[-1]["text_mode"] == "dual"
        assert events[-1]["text_tokens"] == checkpoint_tokens("Spoken after the swap, whole.")
    finally:
        await server.stop()


@pytest.fixture
def checkpoint_tokens(tiny_checkpoint):
    from transformers import AutoTokenizer

    from qwen3_tts_engine.worker.incremental_text import text_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint("custom_voice", eos="text")))
    return lambda text: len(text_token_ids(tokenizer, text))
