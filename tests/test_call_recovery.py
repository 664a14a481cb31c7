"""Calls get their agent back: the conversation kept in the room's metadata, and the call keeper
(`voice-agent keeper`) refusing unsigned webhooks and heartbeats on a real LiveKit server. The
calls themselves (a waiting room served once a worker comes, a SIGKILLed job process and a
SIGKILLed worker replaced by a new agent that has the conversation) run on the two workers of
tests/test_livekit_distribution.py, on one setup."""

from __future__ import annotations

import json

import httpx
import pytest
from aiohttp import web
from livekit import api

from voice_agent.keeper import CallKeeper
from voice_agent.recovery import (
    HISTORY_CHARS,
    HISTORY_TURNS,
    history_from_metadata,
    metadata_with_history,
)

from .engine_process import free_port
from .livekit_server import livekit_server  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")]


def test_the_conversation_lives_in_the_rooms_metadata():
    history = [{"role": "user" if i % 2 == 0 else "assistant", "text": f"message {i} " + "x" * 900}
               for i in range(20)]  # fmt: skip
    stored = metadata_with_history('{"source": "sip"}', history)
    data = json.loads(stored)
    assert data["source"] == "sip"  # what else the room's metadata says is kept
    back = history_from_metadata(stored)
    assert len(back) == HISTORY_TURNS and back[-1]["text"].startswith("message 19")
    assert all(len(h["text"]) == HISTORY_CHARS for h in back)
    for junk in (None, "", "not json", "[1, 2]", '{"voice_agent": {"history": [{"role": "system", "text": "x"}, 5]}}'):
        assert history_from_metadata(junk) == []
    assert json.loads(metadata_with_history("plain text", history[:1]))["metadata"] == "plain text"


async def _serve(keeper: CallKeeper, port: int) -> web.AppRunner:
    runner = web.AppRunner(keeper.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_the_keeper_refuses_unsigned_webhooks_and_heartbeats(livekit_server):  # noqa: F811
    server = livekit_server
    keeper = CallKeeper(server.url, server.api_key, server.api_secret)
    port = free_port()
    runner = await _serve(keeper, port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{base}/webhook", content='{"event": "room_started"}')).status_code == 401
            forged = api.AccessToken(server.api_key, "not-the-secret").with_identity("x").to_jwt()
            r = await c.post(f"{base}/webhook", content="{}", headers={"Authorization": forged})
            assert r.status_code == 401
            beat = {"room": "r1", "identity": "agent-1"}
            assert (await c.post(f"{base}/v1/heartbeat", json=beat)).status_code == 401
            other = (api.AccessToken(server.api_key, server.api_secret).with_identity("agent-1")
                     .with_grants(api.VideoGrants(room="r2")).to_jwt())  # fmt: skip
            r = await c.post(f"{base}/v1/heartbeat", json=beat, headers={"Authorization": f"Bearer {other}"})
            assert r.status_code == 403
            good = (api.AccessToken(server.api_key, server.api_secret).with_identity("agent-1")
                    .with_grants(api.VideoGrants(room="r1")).to_jwt())  # fmt: skip
            r = await c.post(f"{base}/v1/heartbeat", json=beat, headers={"Authorization": f"Bearer {good}"})
            assert r.status_code == 200
            status = (await c.get(f"{base}/v1/status")).json()
            assert "agent-1" in status["rooms"]["r1"]["agents"]
    finally:
        await runner.cleanup()
