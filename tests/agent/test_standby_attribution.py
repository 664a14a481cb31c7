"""The standby phrase answers a reply's own failed attempt, never another stream's: the wrapped
TTS's `error` events are shared by every stream and by the phrases' background synthesis, and a
healthy reply that is merely slow must not be covered because one of those failed (seen once: a
phrase synthesis timed out against a slowed engine and the next reply said "One moment, please."
before its own audio). The wrapped TTS here is a minimal LiveKit TTS (its errors go through
LiveKit's own retry loop and `error` event; a real engine cannot be made to refuse one request
and serve the one beside it on cue). `hold_after=0`: any failure counted would hold at once;
order by events and loop iterations, never by time.
"""

from __future__ import annotations

import asyncio

import pytest
from livekit.agents import APIConnectionError, APIConnectOptions, tts, utils

from voice_agent import standby

RATE = 24000
AUDIO = b"\x10\x00" * (RATE // 100)  # 10 ms that are not the phrases
NO_RETRY = APIConnectOptions(max_retry=0, timeout=30.0)


class _Speaker(tts.TTS):
    """`synthesize()` always fails as if no engine answered (a covered error); a stream that is
    not told to fail waits for `go`, then speaks AUDIO."""

    def __init__(self) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True), sample_rate=RATE,
                         num_channels=1)  # fmt: skip
        self.go = asyncio.Event()
        self.failing_streams = 0  # the next N streams fail (an engine refused them)

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = NO_RETRY):
        return _Refused(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = NO_RETRY):
        fail, self.failing_streams = self.failing_streams > 0, max(0, self.failing_streams - 1)
        return _Slow(tts=self, conn_options=conn_options, fail=fail)


class _Refused(tts.ChunkedStream):
    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        raise APIConnectionError("no engine answered (the phrase synthesis)")


class _Slow(tts.SynthesizeStream):
    def __init__(self, *, tts: _Speaker, conn_options: APIConnectOptions, fail: bool) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._speaker, self._fail = tts, fail

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=RATE, num_channels=1,
                                  mime_type="audio/pcm", stream=True)  # fmt: skip
        async for _ in self._input_ch:
            pass
        if self._fail:
            raise APIConnectionError("no engine answered (another reply)")
        await self._speaker.go.wait()
        output_emitter.start_segment(segment_id=utils.shortuuid())
        output_emitter.push(AUDIO)
        output_emitter.end_segment()


async def _reply(stream: tts.SynthesizeStream) -> bytes:
    stream.push_text("A reply that is slow but whole.")
    stream.end_input()
    return b"".join([bytes(ev.frame.data) async for ev in stream])


def _just(audio: bytes) -> bool:
    """The reply's AUDIO and nothing else (LiveKit may close the segment with silence)."""
    return audio[: len(AUDIO)] == AUDIO and not audio[len(AUDIO) :].strip(b"\x00")


async def _iterations(n: int = 50) -> None:
    for _ in range(n):  # let every callback and task that is ready run
        await asyncio.sleep(0)


@pytest.fixture
def speaker(monkeypatch):
    monkeypatch.setattr(standby, "_SYNTHESIZED", {})
    inner = _Speaker()
    return inner, standby.StandbyTTS(inner, key="attribution", hold_after=0.0)


async def test_a_failed_phrase_synthesis_does_not_hold_a_healthy_reply(speaker):
    inner, wrapped = speaker
    stream = wrapped.stream(conn_options=NO_RETRY)
    try:
        reply = asyncio.create_task(_reply(stream))
        await _iterations()  # the reply's text is in; its engine has not answered yet
        errors: list[tts.TTSError] = []
        inner.on("error", errors.append)
        assert await wrapped.cache_phrases() is False  # the phrases' synthesis failed ...
        assert errors and standby.covered(errors[0].error)  # ... as a covered error event
        await _iterations()  # a hold it had caused would be due now (hold_after 0)
        inner.go.set()
        audio = await asyncio.wait_for(reply, 60)
    finally:
        await stream.aclose()
        await wrapped.aclose()
    assert stream.said == [] and _just(audio)  # the reply's own audio, no phrase before it


async def test_another_replys_failure_does_not_hold_this_one(speaker):
    inner, wrapped = speaker
    inner.failing_streams = 1
    refused, slow = wrapped.stream(conn_options=NO_RETRY), None
    try:
        first = asyncio.create_task(_reply(refused))  # every engine refuses it: covered
        slow = wrapped.stream(conn_options=NO_RETRY)
        second = asyncio.create_task(_reply(slow))
        assert await asyncio.wait_for(first, 60) != b""  # the hold, then the apology
        assert refused.said[-1] == "apology"  # (after the hold if that came first)
        await _iterations()
        inner.go.set()
        audio = await asyncio.wait_for(second, 60)
    finally:
        for s in (refused, slow):
            if s is not None:
                await s.aclose()
        await wrapped.aclose()
    assert slow.said == [] and _just(audio)
