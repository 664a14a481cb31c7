"""The soak benchmark's callers: LiveKit rtc participants that call back to back, speak espeak-ng
turns as 10 ms frames in real time, and record what they hear (the agent's audio frames, its
`lk.transcription` text and state), one record per turn."""

from __future__ import annotations

import asyncio
import bisect
import time
import uuid
from collections.abc import Callable

import numpy as np
from livekit import api, rtc

RATE, FRAME = 48000, 480  # 10 ms frames
SILENT_PEAK = 64  # int16 peak at or below which a frame counts as silence
TOPIC = "lk.transcription"
APOLOGY_WORDS, GREETING_WORDS = "can't think", "cut off"


class CallerRoom:
    """One call: a participant with a microphone track, recording the agent."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.room = rtc.Room()
        self.source = rtc.AudioSource(RATE, 1, queue_size_ms=100)
        self.frames: list[tuple[float, int, str]] = []  # (monotonic time, peak, agent identity)
        self.texts: list[tuple[float, str]] = []  # (monotonic time, agent text)
        self.states: list[tuple[float, str]] = []  # (monotonic time, agent state)
        self.speech_end: float | None = None
        self._speech: np.ndarray | None = None
        self._tasks: set[asyncio.Task] = set()
        self._mic_sid: str | None = None
        self.room.on("track_subscribed", self._on_track)
        self.room.on("participant_attributes_changed", self._on_attributes)
        self.room.register_text_stream_handler(TOPIC, self._on_text)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_track(self, track: rtc.Track, pub, participant: rtc.RemoteParticipant) -> None:
        if track.kind == rtc.TrackKind.KIND_AUDIO:
            self._spawn(self._receive(track, participant.identity))

    def _on_attributes(self, changed: dict, participant) -> None:
        if "lk.agent.state" in changed:
            self.states.append((time.monotonic(), changed["lk.agent.state"]))

    async def _receive(self, track: rtc.Track, identity: str) -> None:
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1):
            samples = np.frombuffer(bytes(ev.frame.data), np.int16)
            peak = int(np.abs(samples.astype(np.int32)).max()) if samples.size else 0
            self.frames.append((time.monotonic(), peak, identity))

    def _on_text(self, reader: rtc.TextStreamReader, sender: str) -> None:
        async def read() -> None:
            text = await reader.read_all()
            attrs = dict(reader.info.attributes or {})
            if sender != self.identity and attrs.get("lk.transcribed_track_id") != self._mic_sid:
                self.texts.append((time.monotonic(), text))

        self._spawn(read())

    def agent(self) -> rtc.RemoteParticipant | None:
        for p in self.room.remote_participants.values():
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                return p
        return None

    def listening_agent(self) -> rtc.RemoteParticipant | None:
        a = self.agent()
        return a if a is not None and a.attributes.get("lk.agent.state") == "listening" else None

    def loud_after(self, t: float, identity: str | None = None, *, other_than: str | None = None) -> float | None:
        """When the agent (any, `identity`, or any but `other_than`) was first heard after `t`."""
        start = bisect.bisect_right(self.frames, t, key=lambda f: f[0])  # frames come in time order
        return next((ft for ft, peak, who in self.frames[start:]
                     if peak > SILENT_PEAK and (identity is None or who == identity) and who != other_than),
                    None)  # fmt: skip

    def text_after(self, t: float) -> str:
        return " ".join(text for tt, text in self.texts if tt > t).lower()

    async def join(self, url: str, token: str) -> None:
        await self.room.connect(url, token)
        track = rtc.LocalAudioTrack.create_audio_track("microphone", self.source)
        opts = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        self._mic_sid = (await self.room.local_participant.publish_track(track, opts)).sid
        self._spawn(self._microphone())

    def say(self, samples: np.ndarray) -> None:
        self.speech_end, self._speech = None, samples

    async def _microphone(self) -> None:
        silence = np.zeros(FRAME, np.int16)
        start, n = time.monotonic(), 0
        while True:
            speech, self._speech = self._speech, None
            if speech is not None:
                for i in range(0, len(speech), FRAME):
                    chunk = speech[i : i + FRAME]
                    chunk = np.pad(chunk, (0, FRAME - len(chunk))) if len(chunk) < FRAME else chunk
                    n = await self._capture(chunk, start, n)
                self.speech_end = time.monotonic() + self.source.queued_duration
            n = await self._capture(silence, start, n)

    async def _capture(self, chunk: np.ndarray, start: float, n: int) -> int:
        await self.source.capture_frame(rtc.AudioFrame(chunk.tobytes(), RATE, 1, FRAME))
        now = time.monotonic()
        if now - (start + n * FRAME / RATE) > 1.0:  # starved (a busy machine): no burst to catch up
            return int((now - start) * RATE / FRAME)
        delay = start + (n + 1) * FRAME / RATE - now
        if delay > 0:
            await asyncio.sleep(delay)
        return n + 1

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.room.disconnect(), 10)
        except Exception:  # the server may be gone (its restart is one of the faults)
            pass
        await self.source.aclose()


async def _until(cond: Callable[[], object], timeout: float, step: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        await asyncio.sleep(step)
    return None


class CallerLoop:
    """Caller `index`: calls (a new room each), `turns_per_call` answered turns per call, then
    hangs up and calls again, until `stop` is set. Each turn becomes a dict in `turns` (see
    soak_report.py); `clock()` gives run time."""

    def __init__(self, index: int, url: str, api_key: str, api_secret: str, speech: list[np.ndarray],
                 clock: Callable[[], float], *, turns_per_call: int = 3, turn_timeout: float = 45.0,
                 agent_wait: float = 30.0, log: Callable[[str], None] = lambda _m: None) -> None:  # fmt: skip
        self.index, self.url, self.key, self.secret = index, url, api_key, api_secret
        self.speech, self.clock, self.log = speech, clock, log
        self.turns_per_call, self.turn_timeout, self.agent_wait = turns_per_call, turn_timeout, agent_wait
        self.turns: list[dict] = []
        self.call: CallerRoom | None = None  # the call in progress
        self.room_name: str | None = None
        self.in_turn = False  # speaking or waiting for the agent's answer
        self.turn_started = 0.0  # run time the turn in progress began
        self.calls = 0
        self.lost_agent: str | None = None  # the agent lost in the middle of this caller's turn
        self.hold = False  # stay on the call (a fault's recovery is being watched in it)
        self.stop = asyncio.Event()

    def _token(self, identity: str, room: str) -> str:
        return (api.AccessToken(self.key, self.secret).with_identity(identity)
                .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip

    async def run(self, lk: api.LiveKitAPI) -> None:
        while not self.stop.is_set():
            self.calls += 1
            name = f"soak-{self.index}-{self.calls}-{uuid.uuid4().hex[:6]}"
            call = CallerRoom(f"caller-{self.index}-{uuid.uuid4().hex[:6]}")
            t_start = self.clock()
            try:
                await asyncio.wait_for(call.join(self.url, self._token(call.identity, name)), 15)
            except Exception as e:
                self._record(t_start, None, "failed", f"join_failed: {type(e).__name__}", room=name)
                await call.close()
                await asyncio.sleep(2.0)
                continue
            self.call, self.room_name = call, name
            self.log(f"caller {self.index}: in a call ({name})")
            try:
                await self._converse(call, name)
            finally:
                self.call = self.room_name = None
                await call.close()
                try:
                    await asyncio.wait_for(lk.room.delete_room(api.DeleteRoomRequest(room=name)), 10)
                except Exception:  # gone already (a server restart), or the server is down
                    pass
            await asyncio.sleep(1.0)

    async def _converse(self, call: CallerRoom, room: str) -> None:
        answered, attempts, n = 0, 0, 0
        self.lost_agent = None
        while not self.stop.is_set() and (self.hold or (answered < self.turns_per_call
                                                       and attempts < 2 * self.turns_per_call)):
            attempts += 1
            outcome = await self._turn(call, room, self.speech[(self.index + n) % len(self.speech)])
            n += 1
            if outcome in ("answer", "apology"):
                answered += 1
            elif outcome in ("no_agent", "disconnected"):
                return  # hang up and call again
            await asyncio.sleep(1.5)

    async def _turn(self, call: CallerRoom, room: str, audio: np.ndarray) -> str:
        t_start = self.clock()
        if not call.room.isconnected():
            return self._record(t_start, None, "failed", "disconnected", room=room)
        agent = await _until(call.listening_agent, self.agent_wait)
        if agent is None:  # what the caller saw instead: the report shows why nobody listened
            seen = [{"identity": p.identity, "kind": int(p.kind), "state": p.attributes.get("lk.agent.state")}
                    for p in call.room.remote_participants.values()]  # fmt: skip
            return self._record(t_start, None, "failed", "no_agent" if call.room.isconnected() else "disconnected",
                                room=room, seen=seen)  # fmt: skip
        identity, worker = agent.identity, agent.attributes.get("worker")
        if self.lost_agent is not None and identity != self.lost_agent:
            # a new agent took over the call: as a person would, let it say it is back first
            await _until(lambda: call.loud_after(0.0, identity) is not None, 20)

            def done_speaking() -> bool:
                last = max((ft for ft, peak, who in call.frames[-200:] if who == identity and peak > SILENT_PEAK),
                           default=0.0)  # fmt: skip
                return call.listening_agent() is not None and time.monotonic() - last > 0.5

            await _until(done_speaking, 30)
            self.lost_agent = None
        self.in_turn, self.turn_started = True, t_start
        try:
            await asyncio.sleep(0.3)  # the agent's subscription to the microphone settles
            call.say(audio)
            if not await _until(lambda: call.speech_end is not None, 30):
                return self._record(t_start, None, "failed", "mic_stalled", room=room, agent=identity, worker=worker)
            end = call.speech_end
            deadline = time.monotonic() + self.turn_timeout
            first, connected = None, time.monotonic()
            while time.monotonic() < deadline:
                first = call.loud_after(end, identity)
                if first is not None:
                    break
                if call.room.connection_state == rtc.ConnectionState.CONN_CONNECTED:
                    connected = time.monotonic()
                if time.monotonic() - connected > 5.0:  # gone, or reconnecting for a while
                    return self._record(t_start, end, "failed", "disconnected", room=room, agent=identity, worker=worker)
                if identity not in call.room.remote_participants:
                    self.lost_agent = identity
                    return self._record(t_start, end, "failed", "agent_lost", room=room, agent=identity, worker=worker)
                await asyncio.sleep(0.05)
            if first is None:
                return self._record(t_start, end, "failed", "no_answer", room=room, agent=identity, worker=worker)
            # the answer goes on until the agent listens again (or leaves)
            await _until(lambda: identity not in call.room.remote_participants or (
                call.listening_agent() is not None and time.monotonic() - first > 0.5), 60)  # fmt: skip
            text = call.text_after(end)
            outcome = ("apology" if APOLOGY_WORDS in text else "greeting" if GREETING_WORDS in text
                       and "noon" not in text else "answer")  # fmt: skip
            committed = next((t for t, s in call.states if t > end and s == "thinking"), None)
            return self._record(t_start, end, outcome, None, room=room, agent=identity, worker=worker,
                                voice_to_voice_s=first - end,
                                first_audio_s=None if committed is None or committed > first else first - committed,
                                text=text[:120])  # fmt: skip
        finally:
            self.in_turn = False

    def _record(self, t_start: float, speech_end: float | None, outcome: str, cause: str | None, **kw) -> str:
        now = time.monotonic()
        to_run = self.clock() - now  # monotonic -> run time
        turn = {"caller": self.index, "t_start": round(t_start, 3),
                "t_speech_end": None if speech_end is None else round(speech_end + to_run, 3),
                "t_done": round(self.clock(), 3), "outcome": outcome, "cause": cause,
                "first_audio_s": None, "voice_to_voice_s": None, **kw}  # fmt: skip
        for k in ("first_audio_s", "voice_to_voice_s"):
            if turn[k] is not None:
                turn[k] = round(turn[k], 3)
        self.turns.append(turn)
        self.log(f"caller {self.index}: {outcome}{f' ({cause})' if cause else ''}"
                 + (f" v2v {turn['voice_to_voice_s']:.2f}s" if turn["voice_to_voice_s"] is not None else ""))
        return outcome if outcome != "failed" else str(cause).split(":")[0]
