"""The caller harness asks again after LiveKit resumes its transport (the room's `reconnected`
event, not a timer): a resume can lose what was in flight, as in a `test_livekit_call` run whose
caller waited out its 120 s for an answer whose text stream never ended.

A real livekit-server; the caller's connection goes through `tests/support/tcp_proxy.py`, which
cuts it (LiveKit's SDK resumes through the proxy). The answering participant answers each
question it hears with an `lk.transcription` text stream; the first answer's stream is left open
(its end "lost"), so the answer can only arrive if the caller asks again after the resume."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
from livekit import api, rtc

from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.support.tcp_proxy import TcpProxy
from voice_agent.harness.caller import FRAME, RATE, SILENT_PEAK, TOPIC, Caller

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long"),
]  # devkey/secret
WAIT = 60.0  # every wait is bounded by this (a hang's bound, not a speed)
QUIET_FRAMES = 30  # 300 ms of silence after sound: a question ended


class Answerer:
    """A participant that answers every question it hears (sound, then 300 ms of silence)."""

    def __init__(self) -> None:
        self.room = rtc.Room()
        self.questions = 0
        self.left_open: list[rtc.TextStreamWriter] = []
        self._tasks: set[asyncio.Task] = set()
        self.room.on("track_subscribed", self._on_track)

    def _on_track(self, track: rtc.Track, pub, participant) -> None:
        if track.kind == rtc.TrackKind.KIND_AUDIO:
            task = asyncio.ensure_future(self._listen(track))
            self._tasks.add(task)

    async def _listen(self, track: rtc.Track) -> None:
        loud, quiet = 0, 0
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1):
            peak = int(np.abs(np.frombuffer(bytes(ev.frame.data), np.int16).astype(np.int32)).max())
            if peak > SILENT_PEAK:
                loud, quiet = loud + 1, 0
            elif loud:
                quiet += 1
                if quiet >= QUIET_FRAMES:
                    loud, quiet = 0, 0
                    self.questions += 1
                    await self._answer()

    async def _answer(self) -> None:
        lp = self.room.local_participant
        if self.questions == 1:  # the answer's stream end is "lost": it never ends
            writer = await lp.stream_text(topic=TOPIC)
            await writer.write("it is no")
            self.left_open.append(writer)
        else:
            await lp.send_text("it is noon", topic=TOPIC)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.room.disconnect()


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


def _token(server, identity: str, room: str, kind: str | None = None) -> str:
    t = api.AccessToken(server.api_key, server.api_secret).with_identity(identity)
    if kind:
        t = t.with_kind(kind)
    return t.with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt()


async def test_the_caller_asks_again_after_livekit_resumes_its_transport(livekit_server):  # noqa: F811
    server = livekit_server
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    proxy = await TcpProxy(port).start()
    room = f"resume-{uuid.uuid4().hex[:8]}"
    caller, answerer = Caller(f"caller-{uuid.uuid4().hex[:6]}"), Answerer()
    t = np.arange(RATE // 2) / RATE  # half a second of tone: the "question"
    question = (0.3 * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    question = np.pad(question, (0, -len(question) % FRAME))
    try:
        await answerer.room.connect(server.url, _token(server, "answerer", room, "agent"))
        await caller.join(f"ws://127.0.0.1:{proxy.port}", _token(server, caller.identity, room))
        await _until(lambda: caller.mic_subscribed is not None, "the answerer's subscription")
        caller.ask(question, answered=lambda: "noon" in caller.agent_transcript())
        # the first answer began and its stream stays open: without asking again, no answer
        await _until(lambda: any("it is no" in t for _, _, t in caller.open_texts.values()),
                     "the first answer's text")  # fmt: skip
        assert answerer.questions == 1 and caller.asked_again == 0
        proxy.set("pass")  # closes the caller's signalling connection: LiveKit resumes
        await _until(lambda: "noon" in caller.agent_transcript(), "the answer after the resume")
    except AssertionError as e:
        raise AssertionError(f"{e}; the caller's connection: {caller.connection_events}, "
                             f"questions heard: {answerer.questions}") from None  # fmt: skip
    finally:
        await caller.close()
        await answerer.close()
        await proxy.aclose()
    events = [e for _, e in caller.connection_events]
    assert "reconnected" in events and events.index("reconnected") < events.index("asked again")
    assert caller.asked_again >= 1 and answerer.questions >= 2
