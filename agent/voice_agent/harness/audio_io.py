"""Audio input and output for running an AgentSession without a LiveKit room.

`PacedAudioInput` behaves like a live microphone: 20 ms frames in real time, silence unless an
utterance is being played into it. `CaptureAudioOutput` records the agent's audio and reports
playback in real time, as a speaker would, so interruptions and timings behave as in a call.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from livekit import rtc
from livekit.agents import utils
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities

FRAME_MS = 20


class PacedAudioInput(AudioInput):
    def __init__(self, sample_rate: int = 48000) -> None:
        super().__init__(label="paced-wav")
        self.sample_rate = sample_rate
        self._ch = utils.aio.Chan[rtc.AudioFrame]()
        self._queue: list[tuple[np.ndarray, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._playing: asyncio.Future | None = None
        self.speech_started_at: float | None = None
        self.speech_ended_at: float | None = None

    async def __anext__(self) -> rtc.AudioFrame:
        if self._task is None:
            self._task = asyncio.create_task(self._pump())
        return await self._ch.__anext__()

    def play(self, samples: np.ndarray) -> asyncio.Future:
        """Queue int16 mono samples at `sample_rate`; the future resolves when they were sent."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((samples.astype(np.int16), fut))
        return fut

    async def _pump(self) -> None:
        n = self.sample_rate * FRAME_MS // 1000
        silence = np.zeros(n, np.int16)
        t_next = time.perf_counter()
        current: np.ndarray | None = None
        offset = 0
        while not self._ch.closed:
            if current is None and self._queue:
                current, self._playing = self._queue.pop(0)
                offset = 0
                self.speech_started_at = time.perf_counter()
            if current is not None:
                block = current[offset : offset + n]
                offset += n
                if len(block) < n:
                    block = np.concatenate([block, silence[: n - len(block)]])
                if offset >= len(current):
                    self.speech_ended_at = time.perf_counter()
                    self._playing.set_result(self.speech_ended_at)
                    current, self._playing = None, None
            else:
                block = silence
            self._ch.send_nowait(rtc.AudioFrame(block.tobytes(), self.sample_rate, 1, n))
            t_next += FRAME_MS / 1000
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))

    async def aclose(self) -> None:
        self._ch.close()
        if self._task:
            await utils.aio.cancel_and_wait(self._task)
        # utterances cut off or never sent: their waiters must not hang
        for fut in [self._playing, *(f for _, f in self._queue)]:
            if fut is not None and not fut.done():
                fut.cancel()
        self._queue.clear()


class CaptureAudioOutput(AudioOutput):
    def __init__(self, sample_rate: int = 24000) -> None:
        super().__init__(label="capture", sample_rate=sample_rate,
                         capabilities=AudioOutputCapabilities(pause=False))  # fmt: skip
        self.frames: list[tuple[float, np.ndarray]] = []  # (wall time, int16 samples)
        self.interruptions: list[tuple[float, float]] = []  # (wall time, played seconds)
        self._started_at = 0.0
        self._pushed = 0.0
        self._finish: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        now = time.perf_counter()
        if not self._pushed:
            self._started_at = now
            self.on_playback_started(created_at=time.time())
        self._pushed += frame.duration
        self.frames.append((now, np.frombuffer(bytes(frame.data), np.int16).copy()))

    def flush(self) -> None:
        super().flush()
        if not self._pushed:
            return
        delay = max(0.0, self._pushed - (time.perf_counter() - self._started_at))
        if self._finish:
            self._finish.cancel()
        self._finish = asyncio.get_running_loop().call_later(delay, self._finished, False)

    def clear_buffer(self) -> None:
        if not self._pushed:
            return
        if self._finish:
            self._finish.cancel()
        played = min(self._pushed, time.perf_counter() - self._started_at)
        self.interruptions.append((time.perf_counter(), played))
        self._finished(True, played)

    def _finished(self, interrupted: bool, played: float | None = None) -> None:
        self._finish = None
        self.on_playback_finished(playback_position=self._pushed if played is None else played,
                                  interrupted=interrupted, synchronized_transcript=None)  # fmt: skip
        self._pushed = 0.0

    def audio_since(self, t: float) -> np.ndarray:
        parts = [a for ts, a in self.frames if ts >= t]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)
