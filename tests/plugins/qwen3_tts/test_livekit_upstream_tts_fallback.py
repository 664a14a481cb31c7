"""LiveKit's own FallbackAdapter tests (livekit/agents `tests/test_tts_fallback.py`), with every
FakeTTS replaced by a qwen3_tts.TTS: the fault upstream scripts into FakeTTS is injected on the
wire instead, by `tests/support/tcp_proxy.py` between the plugin and a `FaultEngine` (the loopback speech
server of test_tts_failover.py: 0.27 s of audio that is a function of text and seed).

Mapping: `fake_exception=APIConnectionError` -> the proxy cuts the connection (`cut`, for every
attempt or for the first `times`); `fake_timeout` with a short `conn_options.timeout` -> `stall`
(a connection that is never answered, so the timeout fires at any machine speed);
`fake_audio_duration=0` -> an empty 200; `synthesize_ch`/`stream_ch` (a call reached the TTS) ->
the endpoint's request count; the 5.0 s of fake audio -> the FaultEngine's audio, compared sample
by sample where no resampling is involved.

Kept: every test of the module and every assertion, except:
- test_reports_active_instance_model_and_provider: both instances are the same provider, so the
  labels differ by model name only.
- test_tts_stream_ttfb_includes_failover_time: upstream's fake1 received the text 0.5 s late (a
  fake connection delay) with `timeout=10`; here the primary stalls and `conn_options.timeout` is
  2 s (the backup answers under it too). The claim is unchanged: the anchor stays on the first
  instance's attempt, not the backup's; upstream's `approx(start, abs=0.1)` is an order on
  perf_counter here: the anchor is at or after the start and before the primary's first error
  event, which comes before the backup is asked (its anchor could only come later).
- test_audio_resampled: qwen3_tts is 24 kHz only, so the adapter is made at 48 kHz
  (`sample_rate=48000`) to resample both; durations are compared within 20 ms (the resampler's
  edges) instead of upstream's exact 5.01 s.
- test_recovery_is_not_suppressed_across_paths: `_GateTTS` parks the recovery probe on an event;
  here the probe parks on a stalled connection with a 600 s timeout, longer than any wait of the
  test. Upstream's final `gate.set()` has nothing to release.
Upstream's waits of 1 s for a recovery or a call are WAIT here: a bound only a hang reaches.
Upstream's `pytest.mark.virtual_time` (a fake clock) is not used: nothing here waits long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import APIConnectionError, APIConnectOptions, APIError, utils
from livekit.agents.tts import TTS, AvailabilityChangedEvent, FallbackAdapter
from livekit.agents.tts.tts import SynthesizedAudio, SynthesizeStream
from livekit.agents.types import USERDATA_TTS_STARTED_TIME
from livekit.agents.utils.aio.channel import ChanEmpty
from livekit.plugins import qwen3_tts

from tests.plugins.qwen3_tts.test_failover import FaultEngine, fake_pcm
from tests.support.tcp_proxy import TcpProxy
from tests.support.tts_audio import pcm

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
FAKE_SECONDS = len(fake_pcm("x", 0)) // 2 / 24000  # the FaultEngine's utterance: 0.269 s
WAIT = (
    30.0  # a bound on any wait for an event (a recovery, a call): a failure, never a timing claim
)
# conn_options.timeout of the stall tests: the primary never answers, so it fires at any speed;
# the backup, on this same loop, answers under it too
STALL = APIConnectOptions(timeout=2.0, max_retry=0, retry_interval=0.1)


class FallbackAdapterTester(FallbackAdapter):
    def __init__(self, tts: list[TTS], *, max_retry_per_tts: int = 1,
                 sample_rate: int | None = None) -> None:  # fmt: skip
        super().__init__(tts, max_retry_per_tts=max_retry_per_tts, sample_rate=sample_rate)
        self.on("tts_availability_changed", self._on_tts_availability_changed)
        self._availability_changed_ch: dict[int, utils.aio.Chan[AvailabilityChangedEvent]] = {
            id(t): utils.aio.Chan[AvailabilityChangedEvent]() for t in tts
        }

    def _on_tts_availability_changed(self, ev: AvailabilityChangedEvent) -> None:
        self._availability_changed_ch[id(ev.tts)].send_nowait(ev)

    def availability_changed_ch(self, tts: TTS) -> utils.aio.ChanReceiver[AvailabilityChangedEvent]:
        return self._availability_changed_ch[id(tts)]


class Wired:
    """A qwen3_tts.TTS whose engine (a FaultEngine) sits behind a TcpProxy."""

    def __init__(self, engine: FaultEngine, proxy: TcpProxy, tts: qwen3_tts.TTS) -> None:
        self.engine, self.proxy, self.tts = engine, proxy, tts

    def calls(self) -> int:
        """Requests the plugin sent (upstream: what arrived on synthesize_ch/stream_ch)."""
        return self.tts.endpoints.endpoints[0].requests

    async def aclose(self) -> None:
        await self.tts.aclose()
        await self.proxy.aclose()
        await self.engine.stop()


@pytest.fixture
async def wire():
    made: list[Wired] = []

    async def make(model: str = "qwen3-tts") -> Wired:
        engine = await FaultEngine().start()
        proxy = await TcpProxy(engine.port).start()
        # FaultEngine speaks sentences over HTTP only; "auto" would first read its status through
        # the faulty proxy, so a fault would hit that read instead of the speech request
        tts = qwen3_tts.TTS(base_url=proxy.url, model=model, voice="ryan", language="en",
                            text_input="sentences")  # fmt: skip
        made.append(Wired(engine, proxy, tts))
        return made[-1]

    yield make
    for w in made:
        await w.aclose()


async def _until(predicate, timeout: float, what: str) -> None:
    """Upstream awaits a fake's channel with asyncio.wait_for(..., timeout); here: a count."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def _error_times(tts: TTS) -> list[float]:
    """perf_counter (LiveKit's clock for the started time) at each of `tts`'s error events."""
    times: list[float] = []
    tts.on("error", lambda _: times.append(time.perf_counter()))
    return times


def _audio(frames: list[rtc.AudioFrame]) -> np.ndarray:
    return np.concatenate([np.frombuffer(bytes(f.data), np.int16) for f in frames])


async def test_reports_active_instance_model_and_provider(wire) -> None:
    w1, w2 = await wire("primary-model"), await wire("fallback-model")
    w1.proxy.set("cut", times=2)  # the attempt and its retry; the recovery probe then passes
    fake1, fake2 = w1.tts, w2.tts
    fallback_adapter = FallbackAdapterTester([fake1, fake2])

    assert fallback_adapter.metrics_metadata == {"model_name": "primary-model",
                                                 "model_provider": "qwen3-tts"}  # fmt: skip
    async with fallback_adapter.synthesize("hello test") as stream:
        async for _ in stream:
            pass
    assert fallback_adapter.metrics_metadata == {"model_name": "fallback-model",
                                                 "model_provider": "qwen3-tts"}  # fmt: skip
    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available

    # a successful recovery probe must not relabel: the caller never heard its audio
    assert (
        await asyncio.wait_for(fallback_adapter.availability_changed_ch(fake1).recv(), WAIT)
    ).available, "fake1 should have recovered"
    assert fallback_adapter.metrics_metadata == {"model_name": "fallback-model",
                                                 "model_provider": "qwen3-tts"}  # fmt: skip

    # once the recovered primary serves real traffic again, the label follows
    async with fallback_adapter.synthesize("hello again") as stream:
        async for _ in stream:
            pass
    assert fallback_adapter.metrics_metadata == {"model_name": "primary-model",
                                                 "model_provider": "qwen3-tts"}  # fmt: skip
    await fallback_adapter.aclose()


async def test_stream_reports_active_instance_model_and_provider(wire) -> None:
    w1, w2 = await wire("primary-model"), await wire("fallback-model")
    w1.proxy.set("cut")
    fallback_adapter = FallbackAdapterTester([w1.tts, w2.tts])
    async with fallback_adapter.stream() as stream:
        stream.push_text("hello test")
        stream.end_input()
        async for _ in stream:
            pass
    assert fallback_adapter.metrics_metadata == {"model_name": "fallback-model",
                                                 "model_provider": "qwen3-tts"}  # fmt: skip
    await fallback_adapter.aclose()


async def test_tts_fallback(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    fake1, fake2 = w1.tts, w2.tts
    fallback_adapter = FallbackAdapterTester([fake1, fake2])

    async with fallback_adapter.synthesize("hello test") as stream:
        frames = []
        async for data in stream:
            frames.append(data)
        assert w1.calls() and w2.calls()
        audio = _audio([f.frame for f in frames if pcm(f) is not None])
        np.testing.assert_array_equal(audio, np.frombuffer(
            fake_pcm("hello test", w2.engine.seen[0]["seed"]), np.int16))  # fmt: skip
    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available

    w2.proxy.set("empty200")  # upstream: fake2.update_options(fake_audio_duration=0.0)
    with pytest.raises(APIConnectionError):
        async with fallback_adapter.synthesize("hello test") as stream:
            async for _ in stream:
                pass
    assert not fallback_adapter.availability_changed_ch(fake2).recv_nowait().available
    await fallback_adapter.aclose()


async def test_no_audio(wire) -> None:
    w1 = await wire()
    w1.proxy.set("empty200")
    fallback_adapter = FallbackAdapterTester([w1.tts])

    with pytest.raises(APIConnectionError):
        async with fallback_adapter.synthesize("hello test chunked") as stream:
            async for _ in stream:
                pass

    async def _input_task(stream: SynthesizeStream, text: str):
        with contextlib.suppress(RuntimeError):
            stream.push_text(text)
            stream.flush()
            stream.end_input()

    async def _stream_task(text: str, has_audio: bool) -> None:
        w1.proxy.set("pass" if has_audio else "empty200")
        async with fallback_adapter.stream() as stream:
            input_task = asyncio.create_task(_input_task(stream, text))
            segments = set()
            try:
                async for ev in stream:
                    segments.add(ev.segment_id)
            finally:
                await input_task
            assert len(segments) == (1 if has_audio else 0)

    await _stream_task("hello test normal", True)
    with pytest.raises(APIError):
        await _stream_task("hello test no audio", False)
    await fallback_adapter.aclose()


async def test_tts_stream_fallback(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    fallback_adapter = FallbackAdapterTester([w1.tts, w2.tts])
    async with fallback_adapter.stream() as stream:
        stream.push_text("hello test")
        stream.end_input()
        async for _ in stream:
            pass
        assert w1.calls() and w2.calls()
    assert not fallback_adapter.availability_changed_ch(w1.tts).recv_nowait().available
    await fallback_adapter.aclose()


async def test_tts_stream_ttfb_includes_failover_time(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("stall")
    primary_errors = _error_times(w1.tts)
    fallback_adapter = FallbackAdapterTester([w1.tts, w2.tts])
    async with fallback_adapter.stream(conn_options=STALL) as stream:
        start = time.perf_counter()
        stream.push_text("hello test")
        stream.end_input()
        frames: list[SynthesizedAudio] = []
        async for data in stream:
            frames.append(data)

    assert frames
    started_times = {f.frame.userdata.get(USERDATA_TTS_STARTED_TIME) for f in frames}
    assert len(started_times) == 1, "all frames should carry the same started time"
    started_time = started_times.pop()
    assert started_time is not None
    # the primary got the sentence first and stalled twice; the anchor stays there: not before
    # the start, and before the primary's first attempt failed (so before the backup was asked)
    assert primary_errors and w2.calls(), (primary_errors, w2.calls())
    assert start <= started_time < primary_errors[0], (start, started_time, primary_errors)
    await fallback_adapter.aclose()


async def test_tts_chunked_ttfb_includes_failover_time(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("stall")  # always times out
    primary_errors = _error_times(w1.tts)
    fallback_adapter = FallbackAdapterTester([w1.tts, w2.tts])
    start = time.perf_counter()
    async with fallback_adapter.synthesize("hello test", conn_options=STALL) as stream:
        frames: list[SynthesizedAudio] = []
        async for data in stream:
            frames.append(data)

    assert frames
    started_times = {f.frame.userdata.get(USERDATA_TTS_STARTED_TIME) for f in frames}
    assert len(started_times) == 1, "all frames should carry the same started time"
    started_time = started_times.pop()
    assert started_time is not None
    assert primary_errors and w2.calls(), (primary_errors, w2.calls())
    assert start <= started_time < primary_errors[0], (start, started_time, primary_errors)
    await fallback_adapter.aclose()


async def test_tts_recover(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    w2.proxy.set("cut", times=2)  # the attempt and its retry; its recovery probe then passes
    fake1, fake2 = w1.tts, w2.tts
    fallback_adapter = FallbackAdapterTester([fake1, fake2])

    with pytest.raises(APIConnectionError):
        async with fallback_adapter.synthesize("hello test") as stream:
            async for _ in stream:
                pass
    assert w1.calls() and w2.calls()
    calls1, calls2 = w1.calls(), w2.calls()

    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available
    assert not fallback_adapter.availability_changed_ch(fake2).recv_nowait().available
    assert (
        await asyncio.wait_for(fallback_adapter.availability_changed_ch(fake2).recv(), WAIT)
    ).available, "fake2 should have recovered"

    async with fallback_adapter.synthesize("hello test") as stream:
        async for _ in stream:
            pass
    assert w1.calls() > calls1 and w2.calls() > calls2

    with pytest.raises(ChanEmpty):
        fallback_adapter.availability_changed_ch(fake1).recv_nowait()
    with pytest.raises(ChanEmpty):
        fallback_adapter.availability_changed_ch(fake2).recv_nowait()
    await fallback_adapter.aclose()


async def test_audio_resampled(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    fake1, fake2 = w1.tts, w2.tts
    fallback_adapter = FallbackAdapterTester([fake1, fake2], sample_rate=48000)

    async with fallback_adapter.synthesize("hello test") as stream:
        frames: list[SynthesizedAudio] = []
        async for data in stream:
            frames.append(data)
        assert w1.calls() and w2.calls()
        assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available
        assert frames[-1].is_final is True, "last frame should be final"
        combined_frame = rtc.combine_audio_frames([f.frame for f in frames])
        assert combined_frame.duration == pytest.approx(FAKE_SECONDS + 0.01, abs=0.02)
        assert combined_frame.sample_rate == 48000

    calls1 = w1.calls()
    await _until(lambda: w1.calls() > calls1, WAIT, "fake1's recovery probe")

    async with fallback_adapter.stream() as stream:
        stream.push_text("hello test")
        stream.end_input()
        frames = []
        async for data in stream:
            frames.append(data)
        assert len(w2.engine.seen) == 2  # the chunked request, then this one
        assert frames[-1].is_final is True, "last frame should be final"
        combined_frame = rtc.combine_audio_frames([f.frame for f in frames])
        assert combined_frame.duration == pytest.approx(FAKE_SECONDS + 0.01, abs=0.02)
        assert combined_frame.sample_rate == 48000
    await fallback_adapter.aclose()


async def test_timeout(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("stall")
    w2.proxy.set("stall")
    fallback_adapter = FallbackAdapterTester([w1.tts, w2.tts])

    with pytest.raises(APIConnectionError):
        async with fallback_adapter.synthesize(
            "hello test", conn_options=APIConnectOptions(timeout=0.1, max_retry=0)
        ) as stream:
            async for _ in stream:
                pass
    assert w1.calls() and w2.calls()
    assert not fallback_adapter.availability_changed_ch(w1.tts).recv_nowait().available
    assert not fallback_adapter.availability_changed_ch(w2.tts).recv_nowait().available
    # upstream's second recv() within 1 s: a second call (the retry or a recovery probe)
    await _until(lambda: w1.calls() >= 2 and w2.calls() >= 2, WAIT, "second calls")

    # stream
    calls = (w1.calls(), w2.calls())
    with pytest.raises(APIConnectionError):
        async with fallback_adapter.stream(
            conn_options=APIConnectOptions(timeout=0.1, max_retry=0)
        ) as stream:
            stream.push_text("hello test")
            stream.end_input()
            async for _ in stream:
                pass
    assert w1.calls() > calls[0] and w2.calls() > calls[1]
    await _until(lambda: w1.calls() >= calls[0] + 2 and w2.calls() >= calls[1] + 2, WAIT,
                 "second calls")  # fmt: skip
    await fallback_adapter.aclose()


async def test_recovery_is_not_suppressed_across_paths(wire) -> None:
    """A recovery probe in flight on one path must not stop the other path from probing."""
    w1, w2 = await wire(), await wire()
    w1.proxy.set("stall")  # recovery probes park here, for longer than any wait below
    w1.proxy.set("cut", times=1)  # ... after the first request fails
    fake1 = w1.tts
    fallback_adapter = FallbackAdapterTester([fake1, w2.tts], max_retry_per_tts=0)
    parked = APIConnectOptions(
        max_retry=0, timeout=600.0
    )  # a probe's conn_options are its stream's

    async with fallback_adapter.stream(conn_options=parked) as stream:
        stream.push_text("hello test")
        stream.end_input()
        async for _ in stream:
            pass
    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available
    # the failing attempt, then the recovery probe, now parked
    await _until(lambda: w1.calls() >= 2, WAIT, "the streamed recovery probe")

    async with fallback_adapter.synthesize("hello test", conn_options=parked) as chunked:
        async for _ in chunked:
            pass
    await _until(lambda: w1.calls() >= 3, WAIT,
                 "chunked path did not probe fake1 while the streamed probe was in flight")  # fmt: skip

    status = fallback_adapter._status[0]
    stream_task = status.recovering_stream_task
    assert stream_task is not None and not stream_task.done()
    assert status.recovering_synthesize_task is not None

    # aclose() must cancel both slots, not just whichever one was written last
    await fallback_adapter.aclose()
    assert stream_task.done()


async def test_tts_recover_on_streamed_path(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    fake1 = w1.tts
    fallback_adapter = FallbackAdapterTester([fake1, w2.tts])

    async def _drive() -> None:
        async with fallback_adapter.stream() as stream:
            stream.push_text("hello test")
            stream.end_input()
            async for _ in stream:
                pass

    await _drive()
    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available
    w1.proxy.set("pass")
    await _drive()  # fake1 is skipped, and must still be probed
    assert (
        await asyncio.wait_for(fallback_adapter.availability_changed_ch(fake1).recv(), WAIT)
    ).available, "fake1 should have recovered on the streamed path"
    await fallback_adapter.aclose()


async def test_no_recovery_probe_after_close(wire) -> None:
    w1, w2 = await wire(), await wire()
    w1.proxy.set("cut")
    fake1 = w1.tts
    fallback_adapter = FallbackAdapterTester([fake1, w2.tts])

    async with fallback_adapter.stream() as stream:
        stream.push_text("hello test")
        stream.end_input()
        async for _ in stream:
            pass
    assert not fallback_adapter.availability_changed_ch(fake1).recv_nowait().available

    # second request left mid-flight, its probe of fake1 pending when the adapter closes
    w1.proxy.set("stall")  # upstream: fake_timeout=30.0, fake_exception=None
    stream = fallback_adapter.stream()
    stream.push_text("hello test")  # deliberately no end_input()
    drain = asyncio.create_task(_drain_stream(stream))

    def probing() -> bool:
        return any(t is not None and not t.done() for s in fallback_adapter._status
                   for t in (s.recovering_synthesize_task, s.recovering_stream_task))  # fmt: skip

    # upstream sleeps 0.5 s for the probe to start; here: until one is in flight (it parks on
    # the stall for the default 10 s timeout, and the adapter closes at once)
    await _until(probing, WAIT, "a recovery probe of fake1")

    await fallback_adapter.aclose()
    await utils.aio.cancel_and_wait(drain)
    await stream.aclose()
    for tts_status in fallback_adapter._status:
        for task in (tts_status.recovering_synthesize_task, tts_status.recovering_stream_task):
            assert task is None or task.done(), "a recovery probe outlived aclose()"


async def _drain_stream(stream: SynthesizeStream) -> None:
    with contextlib.suppress(Exception):
        async for _ in stream:
            pass
