"""A caller in a LiveKit room, for the tests and the soak benchmark: a participant with a
microphone track that speaks (10 ms frames in real time: silence, or the speech given to `say`)
and records what comes back: every remote audio frame's peak, the `lk.transcription` text
streams, the agent's state, and when the agent first subscribed to the microphone."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable

import numpy as np
from livekit import rtc

RATE, FRAME = 48000, 480  # 10 ms frames
SILENT_PEAK = 64  # int16 peak at or below which a frame counts as silence
TOPIC = "lk.transcription"


class Caller:
    """A participant that speaks into a microphone track and records what comes back."""

    def __init__(self, identity: str, *, keep_audio: bool = False) -> None:
        self.identity = identity
        # `keep_audio`: every remote frame's samples too, (monotonic time, int16 at RATE)
        self.audio: list[tuple[float, np.ndarray]] | None = [] if keep_audio else None
        self.room = rtc.Room()
        self.source = rtc.AudioSource(RATE, 1, queue_size_ms=100)
        self.mic_sid: str | None = None
        self.frames: list[tuple[float, int, str]] = []  # (monotonic time, peak, whose audio)
        self.transcripts: list[tuple[str, dict[str, str], str]] = []  # (sender, attributes, text)
        # text streams still open: stream id -> (sender, attributes, the text so far)
        self.open_texts: dict[str, tuple[str, dict[str, str], str]] = {}
        # the caller's own connection to LiveKit: (monotonic time, "reconnecting" | "reconnected"
        # | "disconnected"); on a resume LiveKit may lose data in flight, e.g. a stream's end
        self.connection_events: list[tuple[float, str]] = []
        self.texts: list[tuple[float, str]] = []  # (monotonic time, the agent's text)
        self.states: list[tuple[float, str]] = []  # (monotonic time, the agent's state)
        self.speech_end: float | None = None  # when the speech given to `say` was all played
        # when a participant (the agent: the only other one) first subscribed to the microphone,
        # as LiveKit tells a publisher (once per track: a later subscriber is not told of)
        self.mic_subscribed: float | None = None
        self._speech: np.ndarray | None = None
        # the question `ask` put, until answered: spoken again after each reconnect
        self._question: tuple[np.ndarray, Callable[[], bool]] | None = None
        self.asked_again = 0  # how often a reconnect made it ask again
        self._tasks: set[asyncio.Task] = set()
        self.room.on("track_subscribed", self._on_track)
        self.room.on("participant_attributes_changed", self._on_attributes)
        self.room.on("local_track_subscribed", self._on_mic_subscribed)
        self.room.register_text_stream_handler(TOPIC, self._on_text)
        for event in ("reconnecting", "reconnected", "disconnected"):
            self.room.on(
                event, lambda *_, e=event: self.connection_events.append((time.monotonic(), e))
            )
        self.room.on("reconnected", self._ask_again)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_track(self, track: rtc.Track, pub, participant: rtc.RemoteParticipant) -> None:
        if track.kind == rtc.TrackKind.KIND_AUDIO:
            self._spawn(self._receive(track, participant.identity))

    def _on_mic_subscribed(self, _track) -> None:
        if self.mic_subscribed is None:
            self.mic_subscribed = time.monotonic()

    def _on_attributes(self, changed: dict, participant) -> None:
        if "lk.agent.state" in changed:
            self.states.append((time.monotonic(), changed["lk.agent.state"]))

    async def _receive(self, track: rtc.Track, identity: str) -> None:
        async for ev in rtc.AudioStream(track, sample_rate=RATE, num_channels=1):
            samples = np.frombuffer(bytes(ev.frame.data), np.int16)
            peak = int(np.abs(samples.astype(np.int32)).max()) if samples.size else 0
            self.frames.append((time.monotonic(), peak, identity))
            if self.audio is not None:
                self.audio.append((self.frames[-1][0], samples))

    def _on_text(self, reader: rtc.TextStreamReader, sender: str) -> None:
        async def read() -> None:
            attrs, sid, text = dict(reader.info.attributes or {}), reader.info.stream_id, ""
            try:
                async for chunk in reader:  # word by word while it is spoken
                    text += chunk
                    self.open_texts[sid] = (sender, attrs, text)
            except rtc.StreamError as e:  # its sender left mid-stream: what came is kept
                self.connection_events.append((time.monotonic(), f"text stream broken: {e}"))
            finally:  # also when the caller leaves first (its tasks are cancelled)
                self.open_texts.pop(sid, None)
                self.transcripts.append((sender, attrs, text))
            if sender != self.identity and attrs.get("lk.transcribed_track_id") != self.mic_sid:
                self.texts.append((time.monotonic(), text))

        self._spawn(read())

    @property
    def agent_frames(self) -> list[tuple[float, int]]:
        """(monotonic time, peak) of every frame heard, in time order."""
        return [(t, peak) for t, peak, _ in self.frames]

    def user_transcript(self) -> str:
        """What the agent transcribed of this caller's speech."""
        return " ".join(self.user_texts())

    def user_texts(self, final: bool = False) -> list[str]:
        """The agent's transcripts of this caller's speech, each as sent (only the final ones
        with `final`)."""
        return [t for sender, attrs, t in self.transcripts
                if (sender == self.identity or attrs.get("lk.transcribed_track_id") == self.mic_sid)
                and (not final or attrs.get("lk.transcription_final") == "true")]  # fmt: skip

    def agent_transcript(self) -> str:
        """What the agent said, as text: its text streams that ended (a stream ends as the agent
        finishes speaking it; `open_texts` holds those still open)."""
        return " ".join(t for sender, attrs, t in self.transcripts
                        if sender != self.identity and attrs.get("lk.transcribed_track_id") != self.mic_sid)  # fmt: skip

    def agent(self) -> rtc.RemoteParticipant | None:
        for p in self.room.remote_participants.values():
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                return p
        return None

    def listening_agent(self) -> rtc.RemoteParticipant | None:
        a = self.agent()
        return a if a is not None and a.attributes.get("lk.agent.state") == "listening" else None

    def loud_after(
        self, t: float, identity: str | None = None, *, other_than: str | None = None
    ) -> float | None:
        """When the agent (any, `identity`, or any but `other_than`) was first heard after `t`."""
        start = bisect.bisect_right(self.frames, t, key=lambda f: f[0])  # frames come in time order
        return next((ft for ft, peak, who in self.frames[start:]
                     if peak > SILENT_PEAK and (identity is None or who == identity) and who != other_than),
                    None)  # fmt: skip

    def text_after(self, t: float) -> str:
        """What the agent said after `t`, lower case."""
        return " ".join(text for tt, text in self.texts if tt > t).lower()

    async def join(self, url: str, token: str) -> None:
        await self.room.connect(url, token)
        track = rtc.LocalAudioTrack.create_audio_track("microphone", self.source)
        opts = rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)
        self.mic_sid = (await self.room.local_participant.publish_track(track, opts)).sid
        self._spawn(self._microphone())

    def say(self, samples: np.ndarray) -> None:
        """Speak `samples` (int16 at RATE); `speech_end` is set once they are all played."""
        self.speech_end, self._speech, self._question = None, samples, None

    def ask(self, samples: np.ndarray, answered: Callable[[], bool]) -> None:
        """`say` a question, and say it again after each LiveKit reconnect until `answered()`:
        a resumed transport may have lost what was in flight (the question's audio, the answer's
        text or its stream's end), and a caller would ask again. `speech_end` stays the first
        asking's."""
        self.say(samples)
        self._question = (samples, answered)

    def _ask_again(self) -> None:
        if self._question is None:
            return
        samples, answered = self._question
        if answered():
            self._question = None
            return
        self._speech = samples
        self.asked_again += 1
        self.connection_events.append((time.monotonic(), "asked again"))

    async def _microphone(self) -> None:
        """10 ms frames paced in real time: silence, or the speech given to `say`."""
        silence = np.zeros(FRAME, np.int16)
        start, n = time.monotonic(), 0
        while True:
            speech, self._speech = self._speech, None
            if speech is not None:
                for i in range(0, len(speech), FRAME):
                    chunk = speech[i : i + FRAME]
                    chunk = np.pad(chunk, (0, FRAME - len(chunk))) if len(chunk) < FRAME else chunk
                    n = await self._capture(chunk, start, n)
                if self.speech_end is None:  # (an `ask` said again keeps the first end)
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
        except Exception:  # the server may be gone (its restart is one of the soak's faults)
            pass
        await self.source.aclose()
