"""The soak benchmark's callers: callers (`voice_agent.harness.caller`) that call back to back,
speak espeak-ng turns as 10 ms frames in real time, and record what they hear (the agent's audio
frames, its `lk.transcription` text and state), one record per turn."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import numpy as np
from livekit import api, rtc

from voice_agent.harness.caller import SILENT_PEAK, Caller

APOLOGY_WORDS, GREETING_WORDS = "can't think", "cut off"


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
    report.py); `clock()` gives run time."""

    def __init__(self, index: int, url: str, api_key: str, api_secret: str, speech: list[np.ndarray],
                 clock: Callable[[], float], *, turns_per_call: int = 3, turn_timeout: float = 45.0,
                 agent_wait: float = 30.0, log: Callable[[str], None] = lambda _m: None) -> None:  # fmt: skip
        self.index, self.url, self.key, self.secret = index, url, api_key, api_secret
        self.speech, self.clock, self.log = speech, clock, log
        self.turns_per_call, self.turn_timeout, self.agent_wait = (
            turns_per_call,
            turn_timeout,
            agent_wait,
        )
        self.turns: list[dict] = []
        self.call: Caller | None = None  # the call in progress
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
            call = Caller(f"caller-{self.index}-{uuid.uuid4().hex[:6]}")
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
                    await asyncio.wait_for(
                        lk.room.delete_room(api.DeleteRoomRequest(room=name)), 10
                    )
                except Exception:  # gone already (a server restart), or the server is down
                    pass
            await asyncio.sleep(1.0)

    async def _converse(self, call: Caller, room: str) -> None:
        answered, attempts, n = 0, 0, 0
        self.lost_agent = None
        while not self.stop.is_set() and (
            self.hold or (answered < self.turns_per_call and attempts < 2 * self.turns_per_call)
        ):
            attempts += 1
            outcome = await self._turn(call, room, self.speech[(self.index + n) % len(self.speech)])
            n += 1
            if outcome in ("answer", "apology"):
                answered += 1
            elif outcome in ("no_agent", "disconnected"):
                return  # hang up and call again
            await asyncio.sleep(1.5)

    async def _turn(self, call: Caller, room: str, audio: np.ndarray) -> str:
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
            # the agent hears the microphone once it subscribed to it (LiveKit tells the caller of
            # the first subscription; a replacement agent has spoken its greeting by now, above)
            await _until(lambda: call.mic_subscribed is not None, self.agent_wait)
            call.say(audio)
            if not await _until(lambda: call.speech_end is not None, 30):
                return self._record(
                    t_start, None, "failed", "mic_stalled", room=room, agent=identity, worker=worker
                )
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
                    return self._record(
                        t_start,
                        end,
                        "failed",
                        "disconnected",
                        room=room,
                        agent=identity,
                        worker=worker,
                    )
                if identity not in call.room.remote_participants:
                    self.lost_agent = identity
                    return self._record(
                        t_start,
                        end,
                        "failed",
                        "agent_lost",
                        room=room,
                        agent=identity,
                        worker=worker,
                    )
                await asyncio.sleep(0.05)
            if first is None:
                return self._record(
                    t_start, end, "failed", "no_answer", room=room, agent=identity, worker=worker
                )
            # the answer goes on until the agent listens again (or leaves)
            await _until(lambda: identity not in call.room.remote_participants or (
                call.listening_agent() is not None and time.monotonic() - first > 0.5), 60)  # fmt: skip
            # the reply's transcript arrives when its text stream closes, which can be after the
            # agent's state says it listens again: classify once it is here (an apology read as
            # an empty "answer" kept the outage going for half a minute)
            await _until(lambda: call.text_after(end), 10)
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

    def _record(
        self, t_start: float, speech_end: float | None, outcome: str, cause: str | None, **kw
    ) -> str:
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
        self.log(
            f"caller {self.index}: {outcome}{f' ({cause})' if cause else ''}"
            + (
                f" v2v {turn['voice_to_voice_s']:.2f}s"
                if turn["voice_to_voice_s"] is not None
                else ""
            )
        )
        return outcome if outcome != "failed" else str(cause).split(":")[0]
