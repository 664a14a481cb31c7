"""Calls get their agent back: the call keeper (`voice-agent keeper`) with a real LiveKit server
(its webhooks), a real `voice-agent start` worker (its jobs' heartbeats) and real explicit
dispatch. The two-worker kill is in tests/test_livekit_distribution.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import uuid

import httpx
import pytest
from aiohttp import web
from livekit import api

from voice_agent.demo import load_turn_audio
from voice_agent.keeper import CallKeeper
from voice_agent.recovery import (
    HISTORY_CHARS,
    HISTORY_TURNS,
    history_from_metadata,
    metadata_with_history,
)
from voice_agent.speech_assets import speech_wav

from .engine_process import EngineProcess, free_port
from .livekit_server import livekit_server  # noqa: F401 (the fixture)
from .openai_server import ScriptedChatServer
from .test_livekit_call import (
    QUESTION,
    RATE,
    SILENT_PEAK,
    Caller,
    _start_worker,
    _stop_worker,
    _until,
)

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


def _job_pid(log_text: str, room: str) -> int | None:
    for line in log_text.splitlines():
        if (line.startswith('{"message": "turn:') and f'"room": "{room}"' in line
                and (m := re.search(r'"pid": (\d+)', line))):  # a turn's log line: the job process
            return int(m.group(1))
    return None


async def test_a_waiting_room_and_a_crashed_job_get_an_agent_back(livekit_server, tiny_checkpoint, tmp_path,  # noqa: F811
                                                                  record_property):  # fmt: skip
    """1. A caller waits in a room while no worker is there (LiveKit gives up on it at once):
    the keeper dispatches an agent once a worker comes. 2. That job's process is SIGKILLed after a
    turn: its heartbeats stop, the keeper removes the lingering agent and dispatches a new one,
    which says it is back and answers with the first turn in its context (from the room)."""
    server = livekit_server
    keeper = CallKeeper(server.url, server.api_key, server.api_secret, heartbeat_timeout=3.0, dispatch_wait=2.0)
    runner = await _serve(keeper, server.webhook_port)
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor")
    await asyncio.to_thread(engine.start)
    llm = await ScriptedChatServer().start()
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
           "LIVEKIT_API_SECRET": server.api_secret, "TTS_URL": engine.url, "LLM_BASE_URL": llm.url,
           "LLM_MODEL": "scripted", "TTS_MAX_NEW_TOKENS": "6", "VOICE_AGENT_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0", "VOICE_AGENT_CACHE": str(tmp_path / "va"),
           "AGENT_HTTP_PORT": "0", "AGENT_LOAD_CPU": "0", "KEEPER_URL": f"http://127.0.0.1:{server.webhook_port}"}  # fmt: skip
    room = f"keep-{uuid.uuid4().hex[:8]}"
    caller = Caller(f"caller-{uuid.uuid4().hex[:6]}")
    log = tmp_path / "worker.log"
    worker = None
    question = load_turn_audio(speech_wav(QUESTION, sample_rate=RATE))
    try:
        token = (api.AccessToken(server.api_key, server.api_secret).with_identity(caller.identity)
                 .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip
        await caller.join(server.url, token)  # nobody to dispatch the room to
        await _until(lambda: room in keeper.rooms, "the room_started webhook", 30)
        worker = _start_worker(env, tmp_path, log)
        await _until(lambda: "registered worker" in log.read_text(errors="replace"), "the worker to register")
        await _until(lambda: (a := caller.agent()) is not None and a.attributes.get("lk.agent.state") == "listening",
                     "the keeper's agent to listen")  # fmt: skip
        waited = [r for r in keeper.recoveries if r.room == room]
        assert waited and waited[0].reason.startswith("no agent after") and waited[0].dispatch_id, keeper.recoveries
        first_agent = caller.agent().identity

        # a turn, so that there is a conversation to pick up
        await asyncio.sleep(1.0)
        caller.say(question)
        await _until(lambda: "noon" in caller.agent_transcript().lower(), "the first answer")
        lk = api.LiveKitAPI(server.http_url, server.api_key, server.api_secret)
        try:
            async def stored() -> bool:
                rooms = (await lk.room.list_rooms(api.ListRoomsRequest(names=[room]))).rooms
                return bool(rooms) and any("noon" in h["text"].lower() for h in history_from_metadata(rooms[0].metadata))

            t0 = time.monotonic()
            while not await stored():
                assert time.monotonic() - t0 < 30, "the conversation never reached the room's metadata"
                await asyncio.sleep(0.2)
        finally:
            await lk.aclose()

        # the job process dies without a word
        pid = _job_pid(log.read_text(errors="replace"), room)
        assert pid is not None and pid != worker.pid
        heard = len(caller.agent_frames)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        t_rejoined = await _until(lambda: (a := caller.agent()) is not None and a.identity != first_agent,
                                  "a new agent in the room", 60)  # fmt: skip
        rejoined = t_rejoined - t_kill
        # (frames before the new agent joined may be the old agent's last words)
        await _until(lambda: any(p > SILENT_PEAK and t > t_rejoined for t, p in caller.agent_frames[heard:]),
                     "the new agent's voice", 60)  # fmt: skip
        heard_again = min(t for t, p in caller.agent_frames[heard:] if p > SILENT_PEAK and t > t_rejoined) - t_kill
        lost = [r for r in keeper.recoveries if r.room == room and r.lost_agent == first_agent]
        assert lost and lost[0].reason.startswith("no heartbeat"), keeper.recoveries
        assert first_agent not in caller.room.remote_participants  # removed, not left to time out
        await _until(lambda: "cut off" in caller.agent_transcript().lower(), "the resume greeting")
        asked = len(llm.requests)
        caller.say(question)
        await _until(lambda: len(llm.requests) > asked, "the second question to reach the LLM")
        messages = json.dumps(llm.requests[-1]["messages"]).lower()
        assert "noon" in messages and messages.count("time") >= 2, messages  # the first turn is in context
    except AssertionError as e:
        tail = log.read_text(errors="replace")[-4000:] if log.is_file() else ""
        raise AssertionError(f"{e}\n--- worker log ---\n{tail}\n--- recoveries: {keeper.recoveries}") from None
    finally:
        await caller.close()
        if worker is not None:
            await asyncio.to_thread(_stop_worker, worker)
        await runner.cleanup()
        await llm.stop()
        await asyncio.to_thread(engine.stop)
    print(f"crashed job: a new agent in the room {rejoined:.1f}s and its voice {heard_again:.1f}s after the kill")
    record_property("recovery_rejoined_s", round(rejoined, 2))
    record_property("recovery_heard_s", round(heard_again, 2))
