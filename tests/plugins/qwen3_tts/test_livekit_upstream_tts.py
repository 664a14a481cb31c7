"""LiveKit's own TTS plugin tests (livekit/agents `tests/test_tts.py`), run against qwen3_tts.TTS,
plus the issue's stall claims on a real engine.

Upstream runs each cloud plugin through a toxiproxy container; here the plugin talks to the
in-process tiny engine (conftest `engine`) through `tests/support/tcp_proxy.py` on 127.0.0.1, which passes,
stalls (toxiproxy's `timeout` toxic with timeout 0), cuts once, or answers an empty 200.

Kept, with every assertion that needs neither intelligible speech nor an API key:
- test_tts_synthesize: request ids present and not interleaved, only the last frame final, last
  two frames 0-250 ms, PCM (no compressed container), the TTS's rate and channels, one metrics
  event.
- test_tts_synthesize_timeout / test_tts_stream_timeout: a stalled connection raises
  APITimeoutError with timeout 2.5 s and no retry, not before the timeout; with max_retry=3,
  timeout 0.5 s: APITimeoutError, 4 error events (timeouts, the last one unrecoverable), not
  before 4 x 0.5 s, no metrics. Upstream's windows (1.5-3.5 s, 1-3 s) also bound the time from
  above, which a busy machine can exceed: here a hang guard does (a stall the plugin did not
  time out would hang).
- test_tts_stream: one request id, segment ids, one segment per flushed text, only each
  segment's last frame final, frames 0-250 ms, PCM, rate and channels, one metrics event.
- test_tts_stream_empty: a stream with no text ends cleanly.
- test_tts_stream again (ours: test_tts_stream_capped_before_its_text_is_in), over the socket with
  a longer text of several sentences (as upstream's) and max_new_tokens=4, the rest pushed once
  the cap has ended the first utterance: the same checks and one metrics event.
- test_tts_synthesize_error_propagation, first half: an answer without audio raises APIError
  "no audio frames" (upstream's FakeTTS(fake_audio_duration=0); here an empty 200 on the wire).
- test_tts_synthesize_retry_after_partial_audio: upstream's FakeTTS raised mid-audio once; here
  the connection is cut once after the first audio: two attempts, one recoverable error, two
  request ids not interleaved, the retry's audio is the whole utterance, one metrics event.
Dropped:
- The Deepgram transcription of every result (WER <= 0.2): needs an API key, and the tiny engine's
  random weights speak no words.
- test_tts_synthesize_error_propagation, second half (FakeTTS raising RuntimeError), and
  test_tts_audio_emitter / test_tts_audio_emitter_wav: they test LiveKit's base classes with
  fakes, not a plugin; LiveKit's own CI runs them.
- Upstream's per-provider lists, `job_process` (an aiohttp session for plugins that share
  LiveKit's; this plugin owns its httpx client) and `.env` loading: no cloud providers here.
Changed: upstream's long texts and `fake_llm_stream` (tiktoken, 30 tokens/s) are a short text
pushed word by word at the same rate; the pass-through tests give `conn_options.timeout` 30 s
instead of 5 s and 120 s instead of 30 s to finish (the tiny engine's CPU vocoder takes ~2 s a
chunk on 2 shared cores); the stall tests keep upstream's numbers.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections import defaultdict

import av
import numpy as np
import pytest
from livekit import rtc
from livekit.agents import APIConnectOptions, APIError, APITimeoutError, tts
from livekit.agents.utils import AudioBuffer, aio
from livekit.plugins import qwen3_tts

from tests.support.tcp_proxy import TcpProxy
from tests.support.tts_audio import pcm, stream_text, synthesize

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
TEXT = "How are you doing today?"
FRAMES = 4  # a cap; the tiny checkpoint may end earlier by EOS (fixed by the seed)
PATIENT = APIConnectOptions(max_retry=3, timeout=30)


class EventCollector:
    """Upstream's tests/utils EventCollector."""

    def __init__(self, emitter: rtc.EventEmitter, event: str) -> None:
        emitter.on(event, self._on_event)
        self._events: list = []

    def _on_event(self, *args, **kwargs) -> None:
        self._events.append((args, kwargs))

    @property
    def events(self) -> list:
        return self._events

    @property
    def count(self) -> int:
        return len(self._events)

    def clear(self) -> None:
        self._events.clear()


def _tts(*urls: str, **kw) -> qwen3_tts.TTS:
    kw = {"voice": "ryan", "language": "en", "seed": 11, "max_new_tokens": FRAMES,
          "first_chunk_frames": 1, "probe_interval": 0.2, **kw}  # fmt: skip
    return qwen3_tts.TTS(base_url=list(urls), **kw)


def _engine_url(engine) -> str:
    return f"http://127.0.0.1:{engine.port}"


@pytest.fixture(scope="module")
async def clean(engine):
    """TEXT as the engine says it, straight (no proxy), and the time to its first audio."""
    tts_v = _tts(_engine_url(engine))
    try:
        stream = tts_v.synthesize(TEXT)
        audio = [d async for ev in stream if (d := pcm(ev)) is not None]
    finally:
        await tts_v.aclose()
    return np.concatenate(audio), stream.report.first_audio_s


@pytest.fixture
async def proxy(engine):
    p = await TcpProxy(engine.port).start()
    yield p
    await p.aclose()


def assert_pcm_audio(*, frames: AudioBuffer, sample_rate: int, num_channels: int) -> None:
    """Upstream's assert_valid_synthesized_audio without its Deepgram transcription."""
    frame = rtc.combine_audio_frames(frames)
    compressed_formats = {"mp3", "aac", "ogg", "flac", "wav", "mov,mp4,m4a,3gp,3g2,mj2",
                          "matroska,webm", "mpeg"}  # fmt: skip
    try:
        container = av.open(
            io.BytesIO(frame.data), options={"probe_size": "32", "analyzeduration": "0"}
        )
        name = container.format.name
        container.close()
        assert name not in compressed_formats, f"Audio data isn't PCM (detected {name})"
    except av.InvalidDataError:
        pass
    assert len(frame.data) >= frame.samples_per_channel
    assert frame.sample_rate == sample_rate, "sample rate should be the same"
    assert frame.num_channels == num_channels, "num channels should be the same"


async def _do_synthesis(tts_v: tts.TTS, segment: str, *, conn_options: APIConnectOptions):
    tts_stream = tts_v.synthesize(text=segment, conn_options=conn_options)
    try:
        audio_events = [event async for event in tts_stream]
    finally:
        await tts_stream.aclose()

    request_ids = [event.request_id for event in audio_events]
    assert all(request_ids), "expected all frames to have a request_id"
    unique_ids = list(dict.fromkeys(request_ids))
    contiguous_ids = [rid for rid, _ in itertools.groupby(request_ids)]
    assert contiguous_ids == unique_ids, (
        f"expected request_ids to not interleave between attempts, got {request_ids}"
    )
    audio_events = [event for event in audio_events if event.request_id == unique_ids[-1]]
    assert all(not event.is_final for event in audio_events[:-1]), (
        "expected all audio events to be non-final"
    )
    assert 0 < audio_events[-2].frame.duration < 0.25, (
        f"expected second last frame to not be empty, got {audio_events[-2].frame.duration}"
    )
    assert audio_events[-1].is_final, "expected last audio event to be final"
    assert 0 < audio_events[-1].frame.duration < 0.25, (
        f"expected last frame to not be empty, got {audio_events[-1].frame.duration}"
    )
    assert_pcm_audio(frames=[e.frame for e in audio_events], sample_rate=tts_v.sample_rate,
                     num_channels=tts_v.num_channels)  # fmt: skip


async def _llm_tokens(text: str, tokens_per_second: float = 30.0):
    """Stands in for upstream's fake_llm_stream (tiktoken tokens): words at the same rate."""
    for i, word in enumerate(text.split(" ")):
        yield word if i == 0 else " " + word
        await asyncio.sleep(1.0 / tokens_per_second)


async def _do_stream(tts_v: tts.TTS, segments: list[str], *, conn_options: APIConnectOptions,
                     gate=None):  # fmt: skip
    """Upstream's _do_stream; `gate()` (ours) is awaited once, after the first sentence's end is
    pushed. Returns the stream."""
    async with tts_v.stream(conn_options=conn_options) as tts_stream:

        async def _push_text() -> None:
            gated = gate is None
            for text in segments:
                async for token in _llm_tokens(text):
                    tts_stream.push_text(token)
                    if not gated and token.rstrip().endswith((".", "?", "!")):
                        gated = True
                        await gate()
                tts_stream.flush()
            tts_stream.end_input()

        push_text_task = asyncio.create_task(_push_text())
        audio_events: list[tts.SynthesizedAudio] = []
        try:
            async for event in tts_stream:
                audio_events.append(event)
        except BaseException:
            await aio.cancel_and_wait(push_text_task)
            raise

        assert push_text_task.done(), "expected push_text_task to be done"
        if not segments:
            return tts_stream

        request_id = audio_events[0].request_id
        assert request_id, "expected to have a request_id"
        assert all(e.request_id == request_id for e in audio_events), (
            "expected all frames to have the same request_id"
        )
        assert all(e.segment_id for e in audio_events), "expected all events to have a segment_id"
        by_segment: dict[str, list[tts.SynthesizedAudio]] = defaultdict(list)
        for e in audio_events:
            by_segment[e.segment_id].append(e)
        assert len(by_segment) == len(segments), (
            "expected one unique segment_id per pushed text segment"
        )
        for segment_events in by_segment.values():
            *non_final, final = segment_events
            assert final.is_final, "last frame of a segment must be final"
            assert all(not e.is_final for e in non_final), (
                "only the last frame within a segment may be final"
            )
            assert 0 < final.frame.duration < 0.25, "expected final frame to be non-empty (<250 ms)"
            assert all(0.00 < e.frame.duration < 0.25 for e in non_final), (
                "expected non-final frames to be 0-250 ms"
            )
            assert_pcm_audio(frames=[e.frame for e in segment_events],
                             sample_rate=tts_v.sample_rate, num_channels=tts_v.num_channels)  # fmt: skip
    return tts_stream


# -- upstream tests/test_tts.py ----------------------------------------------------------------


async def test_tts_synthesize(proxy):
    tts_v = _tts(proxy.url)
    tts_v.prewarm()
    metrics_collected_events = EventCollector(tts_v, "metrics_collected")
    try:
        await asyncio.wait_for(_do_synthesis(tts_v, TEXT, conn_options=PATIENT), timeout=120)
    finally:
        await tts_v.aclose()
    assert metrics_collected_events.count == 1, (
        f"expected 1 metrics collected event, got {metrics_collected_events.count}"
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["synthesize", "stream"])
async def test_tts_timeout(proxy, streamed):
    """Upstream's test_tts_synthesize_timeout and test_tts_stream_timeout."""
    proxy.set("stall")
    tts_v = _tts(proxy.url)

    def run(conn_options):
        if streamed:
            return _do_stream(tts_v, [TEXT], conn_options=conn_options)
        return _do_synthesis(tts_v, TEXT, conn_options=conn_options)

    # LiveKit's timers run on the loop's clock: a timeout cannot end sooner on it, on any
    # machine; how much later it ends is the machine's business (a hang guard bounds it)
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        try:
            with pytest.raises(APITimeoutError):
                await asyncio.wait_for(
                    run(APIConnectOptions(max_retry=0, timeout=2.5)), timeout=120
                )
        except TimeoutError:
            pytest.fail("the stall was never timed out (hang guard: 120 s)")
        elapsed_time = loop.time() - start
        print(f"one attempt: APITimeoutError after {elapsed_time:.2f} s (timeout 2.5 s)")
        assert elapsed_time >= 2.5, (
            f"timed out after {elapsed_time:.2f} s, before the 2.5 s timeout"
        )

        # test retries
        error_events = EventCollector(tts_v, "error")
        metrics_collected_events = EventCollector(tts_v, "metrics_collected")
        start = loop.time()
        try:
            with pytest.raises(APITimeoutError):
                await asyncio.wait_for(run(APIConnectOptions(max_retry=3, timeout=0.5, retry_interval=0.0)),
                                       timeout=120)  # fmt: skip
        except TimeoutError:
            pytest.fail("the stalls were never timed out (hang guard: 120 s)")
        elapsed_time = loop.time() - start
        print(f"four attempts: APITimeoutError after {elapsed_time:.2f} s (timeout 0.5 s each)")
        assert error_events.count == 4, f"expected 4 errors, got {error_events.count}"
        errors = [args[0] for args, _ in error_events.events]
        assert all(isinstance(e.error, APITimeoutError) for e in errors), errors
        assert [e.recoverable for e in errors] == [True, True, True, False], errors
        assert elapsed_time >= 4 * 0.5, f"four attempts timed out after {elapsed_time:.2f} s in all"
        assert metrics_collected_events.count == 0, (
            f"expected 0 metrics collected events, got {metrics_collected_events.count}"
        )
    finally:
        await tts_v.aclose()


async def test_tts_synthesize_error_propagation(proxy):
    proxy.set("empty200")
    tts_v = _tts(proxy.url)
    try:
        with pytest.raises(APIError, match="no audio frames"):
            await _do_synthesis(tts_v, "fake_text",
                                conn_options=APIConnectOptions(max_retry=0, timeout=30))  # fmt: skip
    finally:
        await tts_v.aclose()


async def test_tts_synthesize_retry_after_partial_audio(proxy, clean):
    whole, _ = clean
    proxy.set("cut", after=3000, times=1)  # part of the first chunk, then the connection drops
    tts_v = _tts(proxy.url)
    error_events = EventCollector(tts_v, "error")
    metrics_collected_events = EventCollector(tts_v, "metrics_collected")
    try:
        stream = tts_v.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=3, timeout=30))
        audio_events = [ev async for ev in stream]

        assert stream.attempts == 2, f"expected 1 retry, got {stream.attempts} attempts"
        assert error_events.count == 1, f"expected 1 error event, got {error_events.count}"
        assert error_events.events[0][0][0].recoverable is True
        request_ids = [ev.request_id for ev in audio_events]
        assert len(set(request_ids)) == 2, f"expected 2 request_ids, got {set(request_ids)}"
        retry_start = request_ids.index(request_ids[-1])
        assert all(rid == request_ids[0] for rid in request_ids[:retry_start])
        retry_events = audio_events[retry_start:]
        assert retry_events[-1].is_final, "expected last audio event to be final"
        # the retry resynthesizes the whole utterance (upstream: its 1.0 s of fake audio)
        retry_audio = np.concatenate(
            [np.frombuffer(bytes(ev.frame.data), np.int16) for ev in retry_events]
        )
        assert np.array_equal(retry_audio[: len(whole)], whole)
        assert not retry_audio[len(whole) :].any()  # at most LiveKit's 10 ms end marker
        await stream.aclose()  # settles the metrics task
        assert metrics_collected_events.count == 1, (
            f"expected 1 metrics collected event, got {metrics_collected_events.count}"
        )
    finally:
        await tts_v.aclose()


async def test_tts_stream(proxy):
    tts_v = _tts(proxy.url)
    tts_v.prewarm()
    metrics_collected_events = EventCollector(tts_v, "metrics_collected")
    try:
        await asyncio.wait_for(_do_stream(tts_v, [TEXT], conn_options=PATIENT), timeout=120)
        assert metrics_collected_events.count == 1, (
            f"expected 1 metrics collected event, got {metrics_collected_events.count}"
        )
    finally:
        await tts_v.aclose()


async def test_tts_stream_capped_before_its_text_is_in(engine):
    """Upstream's test_tts_stream over the socket with max_new_tokens=4 (FRAMES), where the cap
    ends the first utterance while its text is still coming: the rest of the reply is pushed
    only once the engine has ended that utterance (an event on the engine, whatever its speed).
    The cap is per sentence on both paths, so the sentences after it are utterances of their
    own: the upstream checks hold and there is exactly one metrics event (before: none, 6 audio
    frames, and the rest of the text dropped)."""
    first = "Well, how are you doing on this fine and sunny morning today?"
    rest = ["I am doing very well, thank you for asking me about it.", "It is a lovely day."]
    handler = engine.engine.active
    before = handler.last_stats

    async def engine_ended_an_utterance() -> None:  # by its cap, text open: the first sentence
        while handler.last_stats is before or not handler.last_stats.get("hit_token_cap"):
            await asyncio.sleep(0.02)

    tts_v = _tts(_engine_url(engine), text_input="stream")
    metrics_collected_events = EventCollector(tts_v, "metrics_collected")
    try:
        stream = await asyncio.wait_for(_do_stream(tts_v, [" ".join([first, *rest])],
                                                   conn_options=PATIENT, gate=engine_ended_an_utterance),
                                        timeout=120)  # fmt: skip
        assert metrics_collected_events.count == 1, (
            f"expected 1 metrics collected event, got {metrics_collected_events.count}"
        )
    finally:
        await tts_v.aclose()
    # Every sentence reached the engine, as an utterance of its own (the first capped before
    # its text was in; a later one may be too, the LLM's pace being 30 words a second).
    assert stream.text_streams[0].ended_early
    assert len(stream.text_streams) == 1 + len(rest)
    for sentence, report in zip([first, *rest], stream.text_streams, strict=True):
        assert report.text.strip() and sentence.startswith(report.text.strip())


async def test_tts_stream_empty(proxy):
    tts_v = _tts(proxy.url)
    try:
        await asyncio.wait_for(_do_stream(tts_v, [], conn_options=PATIENT), timeout=30)
    finally:
        await tts_v.aclose()


# -- the claims on a real engine -------------------------------------------------------


async def test_stall_mid_audio_fails_over_sample_exact_after_the_timeout(proxy, engine):
    """The agent's path (a stream): the engine answers the head and some audio, then nothing.
    The stall is detected by conn_options.timeout (no byte for that long; not sooner) and the
    utterance continues on the second endpoint, sample-exact (same seed; the bytes already
    played are skipped). Two 1-frame chunks, and a timeout that no real wait for this tiny
    engine's next chunk comes near, even on a loaded machine (the failover's own first chunk
    waits under it too); how soon after the timeout the failover happens is the machine's
    business (a hang guard bounds it). (A stall before any byte, and stalls with one endpoint:
    test_tts_failover.py, on both paths.)"""
    loop = asyncio.get_running_loop()
    conn = APIConnectOptions(max_retry=0, timeout=10.0)
    reference = _tts(_engine_url(engine), max_new_tokens=2)  # overrides FRAMES
    try:
        whole = await synthesize(reference, TEXT)
    finally:
        await reference.aclose()
    proxy.set("stall", after=3000)  # inside the first chunk (3840 bytes)
    # the sentence path (a streamed segment may rightly be silent while its text is open); proxy first
    tts_v = _tts(proxy.url, _engine_url(engine), max_new_tokens=2, strategy="priority",
                 text_input="sentences")  # fmt: skip
    marked: list[tuple[float, str]] = []
    mark_down = tts_v.endpoints.mark_down
    tts_v.endpoints.mark_down = lambda ep, why: (
        marked.append((loop.time(), why)),
        mark_down(ep, why),
    )
    try:
        stream, audio = await asyncio.wait_for(stream_text(tts_v, [TEXT], conn_options=conn), 300)
    finally:
        await tts_v.aclose()
    report = stream.sentences[0]
    assert report.endpoints == [proxy.url, _engine_url(engine)]
    assert 0 < report.skipped_bytes <= 3000  # what got through, less chunked framing
    np.testing.assert_array_equal(audio, whole)
    # the stalled endpoint was given up on by the timeout, once: on the loop's clock, no sooner
    # than the timeout after the proxy passed its last byte
    ((t_marked, why),) = marked
    assert f"no audio for {conn.timeout:g} s after" in why, why
    since_stall = t_marked - proxy.stalled_at
    print(f"stall detected {since_stall:.2f} s after it began (timeout {conn.timeout:.2f} s)")
    assert since_stall >= conn.timeout
