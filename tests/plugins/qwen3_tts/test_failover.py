"""Failover claims of the Qwen3-TTS plugin, against faults injected on real HTTP (127.0.0.1).

`FaultEngine` speaks the engine's streaming protocol (200, chunked audio/pcm) with audio that is a
pure function of (text, seed), and fails on demand: HTTP 500/503, a cut or short body mid-audio,
or a stall before or after the first byte. It reports a load on `GET /load` as an engine does; in
the `pair` fixture y reports one stream of another client's, so both strategies (`balanced`, by
load; `priority`, by order) try x first. One test kills a real tiny engine mid-sentence.
"""

from __future__ import annotations

import asyncio
import zlib

import httpx
import numpy as np
import pytest
from aiohttp import web
from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError, APITimeoutError
from livekit.agents.tts import FallbackAdapter
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES
from tests.support.engine_process import EngineProcess, free_port
from tests.support.tts_audio import pcm, stream_text, synthesize

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
SENTENCES = ["The first sentence is here.", "Then comes the second one."]
# Ignoring conn_options would leave a stalled request to this client default: far past any wait
# below, so a test that needs conn_options.timeout fails instead of passing slowly.
PATIENT_CLIENT = httpx.Timeout(300.0)
WAIT = 30.0  # generous bound on anything a test waits for: a failure, never a timing claim
# conn_options.timeout where a test needs it to fire: against a stall that never ends (FaultEngine
# holds a stalled handler until stop), so it fires at any machine speed. Where a healthy endpoint
# answers under the same options, this is how long a loaded loop may keep its loopback bytes.
STALL_TIMEOUT = 2.0
# conn_options where the timeout is not what a test looks at: only a hang reaches it
PATIENT = APIConnectOptions(max_retry=0, timeout=60.0)
# real engines on a loaded 2-core machine: a sentence's first audio may take longer than LiveKit's
# default 10 s (a stall is not what these tests look for)
REAL_ENGINE = APIConnectOptions(timeout=120.0)
FAULTS = ["500", "503", "cut", "short", "stall_head", "stall_body"]


def fake_pcm(text: str, seed: int) -> bytes:
    """What FaultEngine says for `text` with `seed`: 3.3 frames of noise, a different one per seed."""
    rng = np.random.default_rng([seed, zlib.crc32(text.encode())])
    return rng.integers(-8000, 8000, 3 * FRAME_SAMPLES + 700, dtype=np.int16).tobytes()


class FaultEngine:
    """A loopback speech server; `fault` applies to every request until it is set back to None."""

    def __init__(self) -> None:
        self.fault: str | None = None
        self.cut_after = 2 * 3840 + 1  # bytes of audio sent before a mid-utterance fault: odd
        self.seen: list[dict] = []  # request bodies, in arrival order
        self.ready = True
        self.stall_ready = False
        self.running: int | None = 0  # streams GET /load reports (None: no /load, as older engines)
        self.slots = 4
        self.pace: float | None = (
            None  # if set: one request at a time, 1920-byte chunks this far apart
        )
        self._one_at_a_time = asyncio.Lock()
        self.port = free_port()
        self._release = asyncio.Event()  # frees stalled handlers at stop
        app = web.Application()
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/load", self._load)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inputs(self) -> list[str]:
        return [b["input"] for b in self.seen]

    async def start(self) -> FaultEngine:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self._release.set()
        await self._runner.cleanup()

    async def _ready(self, request: web.Request) -> web.Response:
        if self.stall_ready:
            await self._release.wait()
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def _load(self, request: web.Request) -> web.Response:
        if self.running is None:
            raise web.HTTPNotFound()
        free = max(0, self.slots - self.running)
        return web.json_response({"running": self.running, "waiting": 0, "max_batch": self.slots,
                                  "slots": self.slots, "free_slots": free, "accepting": True,
                                  "state": "serving", "underruns": 0})  # fmt: skip

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        pcm, fault = fake_pcm(body["input"], body["seed"]), self.fault
        if fault in ("500", "503"):
            return web.json_response({"error": {"message": f"fault {fault}"}}, status=int(fault))
        if fault == "stall_head":
            await self._release.wait()
            raise ConnectionResetError
        if self.pace is not None:
            async with self._one_at_a_time:  # like an engine: the next request waits its turn
                return await self._paced(request, pcm)
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        if fault == "short":
            resp.content_length = len(pcm)  # announces all of it, sends part, then hangs up
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        if fault in ("cut", "short", "stall_body"):
            await resp.write(pcm[: self.cut_after])
            if fault == "stall_body":
                await self._release.wait()
            request.transport.close()
            return resp
        for i in range(0, len(pcm), 3840):
            await resp.write(pcm[i : i + 3840])
        await resp.write_eof()
        return resp

    async def _paced(self, request: web.Request, pcm: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        for i in range(0, len(pcm), 1920):
            await asyncio.sleep(self.pace)
            if i == 0:
                await resp.prepare(
                    request
                )  # the head goes out with the first audio, as the engine's does
            await resp.write(pcm[i : i + 1920])
        await resp.write_eof()
        return resp


def _tts(urls, **kw) -> qwen3_tts.TTS:
    kw.setdefault("voice", "ryan")
    kw.setdefault("language", "en")
    kw.setdefault("text_input", "sentences")  # the real engine's socket: test_text_stream.py
    # every request's first chunk as synthesize()'s: the same chunking, so the same int16 rounding
    kw.setdefault("first_clause_chunk_frames", None)
    return qwen3_tts.TTS(base_url=urls, probe_interval=0.2, timeout=PATIENT_CLIENT, **kw)


async def _until(predicate, what: str) -> None:
    """Poll `predicate` until true or WAIT seconds (generous: a failure, not a slow pass)."""
    for _ in range(int(WAIT / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {WAIT} s: {what}")


def _pcm(text: str, seed: int) -> np.ndarray:
    return np.frombuffer(fake_pcm(text, seed), dtype=np.int16)


@pytest.fixture
async def pair():
    x, y = await FaultEngine().start(), await FaultEngine().start()
    y.running = 1  # another client's stream: x is the less loaded, and first in order
    yield x, y
    await x.stop()
    await y.stop()


@pytest.mark.parametrize("strategy", ["balanced", "priority"])
@pytest.mark.parametrize("fault", FAULTS)
async def test_fault_fails_over_exactly_and_endpoint_comes_back(pair, fault, strategy):
    """A 5xx before the first byte, a cut/short body or a stall mid-utterance, a stall before any
    byte: the stream continues on the other endpoint with the same seed and sample-exact audio,
    the faulty endpoint is not used while down, and is used again once its /ready answers (probed
    while a stream is open)."""
    x, y = pair
    x.fault, x.ready = fault, False
    tts = _tts([x.url, y.url], strategy=strategy)  # no seed: the plugin draws one per sentence
    # a stall is found by the timeout (x never answers); the other faults need none
    stall = fault in ("stall_head", "stall_body")
    conn = APIConnectOptions(max_retry=0, timeout=STALL_TIMEOUT) if stall else PATIENT
    try:
        stream, audio = await asyncio.wait_for(stream_text(tts, SENTENCES, conn_options=conn), WAIT)
        reports = stream.sentences
        assert [r.text for r in reports] == SENTENCES
        assert reports[0].endpoints == [x.url, y.url]
        assert len({r.seed for r in reports}) == len(SENTENCES)
        for r in reports:  # every attempt carried the sentence's one seed
            sent = [b["seed"] for b in x.seen + y.seen if b["input"] == r.text]
            assert sent == [r.seed] * len(r.endpoints), (r, sent)
        mid_utterance = fault in ("cut", "short", "stall_body")
        assert (
            (reports[0].skipped_bytes == x.cut_after)
            if mid_utterance
            else reports[0].skipped_bytes == 0
        )
        # Nothing lost, nothing twice: what the listener got is each sentence once, as y says it.
        expected = np.concatenate([_pcm(r.text, r.seed) for r in reports])
        assert audio.shape == expected.shape
        np.testing.assert_array_equal(audio, expected)

        ep_x = tts.endpoints.endpoints[0]
        assert not ep_x.healthy and ep_x.last_error
        # Down: not tried again (its probe keeps failing, /ready answers 503).
        n = len(x.seen)
        await synthesize(tts, "Spoken while x is down.", conn_options=PATIENT)
        assert len(x.seen) == n and y.inputs()[-1] == "Spoken while x is down."
        # Back: once /ready answers 200 the background probe restores it, and it serves again.
        x.fault, x.ready = None, True
        async with tts.stream(conn_options=PATIENT):  # the pool probes while a stream is open
            await _until(lambda: ep_x.healthy, "x probed back")
        got = await synthesize(tts, "Back on x now.", conn_options=PATIENT)
        assert x.inputs()[-1] == "Back on x now." and len(x.seen) == n + 1
        np.testing.assert_array_equal(got, _pcm("Back on x now.", x.seen[-1]["seed"]))
    finally:
        await tts.aclose()


async def test_sentence_queued_behind_a_long_one_is_not_a_stall(pair):
    """The engine answers one request at a time: a prefetched sentence gets no byte until the one
    ahead is done, which takes longer than conn_options.timeout though audio never pauses that
    long. Waiting its turn is not a stall: no failover, no error. (The wait is at least the
    7 paced sleeps, 3.5 s, past the 2 s timeout at any speed; each gap is one 0.5 s sleep, which
    only a loop held up for 1.5 s more would stretch past the timeout.)"""
    x, _ = pair
    x.pace = 0.5  # 7 chunks: >= 3.5 s a sentence, gaps well under the timeout
    tts = _tts([x.url])
    conn = APIConnectOptions(max_retry=0, timeout=STALL_TIMEOUT)
    try:
        stream, audio = await asyncio.wait_for(stream_text(tts, SENTENCES, conn_options=conn), WAIT)
        assert [r.endpoints for r in stream.sentences] == [[x.url]] * len(SENTENCES)
        assert x.inputs() == SENTENCES and tts.endpoints.endpoints[0].healthy
        np.testing.assert_array_equal(
            audio, np.concatenate([_pcm(r.text, r.seed) for r in stream.sentences])
        )
    finally:
        await tts.aclose()


@pytest.mark.parametrize("streamed", [False, True], ids=["synthesize", "stream"])
@pytest.mark.parametrize(
    ("fault", "error"),
    [("500", APIStatusError), ("503", APIStatusError), ("cut", APIConnectionError),
     ("short", APIConnectionError), ("stall_head", APITimeoutError), ("stall_body", APITimeoutError)],
)  # fmt: skip
async def test_last_endpoint_fault_raises_the_livekit_error(pair, fault, error, streamed):
    """With nowhere left to fail over, the fault surfaces as the exception LiveKit retries or
    falls back on, from synthesize() and stream() alike. A stall (one that never ends) is cut by
    conn_options.timeout, not the client's 300 s: the call raises APITimeoutError inside the
    WAIT hang guard (else the guard's TimeoutError fails pytest.raises), and, on the loop's clock
    that LiveKit's timers run on, no sooner than the timeout after the call began."""
    x, _ = pair
    x.fault = fault
    tts = _tts([x.url])
    # only x, and it fails: the timeout fires for a stall, the other faults need none
    conn = APIConnectOptions(max_retry=0, timeout=0.5) if error is APITimeoutError else PATIENT
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        with pytest.raises(error) as e:
            if streamed:
                await asyncio.wait_for(
                    stream_text(tts, ["Nobody can say this."], conn_options=conn), WAIT
                )
            else:
                await asyncio.wait_for(
                    synthesize(tts, "Nobody can say this.", conn_options=conn), WAIT
                )
        if error is APIStatusError:
            assert e.value.status_code == int(fault) and e.value.retryable
        if error is APITimeoutError:
            assert loop.time() - start >= conn.timeout
    finally:
        await tts.aclose()


@pytest.mark.parametrize("streamed", [False, True], ids=["synthesize", "stream"])
async def test_retries_and_failover_add_up_not_multiply(pair, streamed):
    """Two stalled endpoints and max_retry=3: the first attempt fails over from x to y, each of
    LiveKit's three retries is one more try (on the endpoint that failed longest ago): 2 + 3
    requests, not 2 x 4, and 4 error events, as LiveKit's base classes count attempts."""
    x, y = pair
    x.fault = y.fault = "stall_head"
    tts = _tts([x.url, y.url])
    errors = []
    tts.on("error", errors.append)
    conn = APIConnectOptions(max_retry=3, timeout=0.3, retry_interval=0.0)
    try:
        with pytest.raises(APITimeoutError):
            if streamed:
                await asyncio.wait_for(stream_text(tts, SENTENCES[:1], conn_options=conn), WAIT)
            else:
                await asyncio.wait_for(synthesize(tts, SENTENCES[0], conn_options=conn), WAIT)
    finally:
        await tts.aclose()
    assert len(x.seen) + len(y.seen) == 2 + 3, (len(x.seen), len(y.seen))
    assert (len(x.seen), len(y.seen)) == (3, 2)  # x, y, then x, y, x: the longest failed first
    assert [e.recoverable for e in errors] == [True, True, True, False]


async def test_a_retry_fails_over_again_once_its_audio_has_played(pair):
    """Both endpoints fail (503) and LiveKit retries: the retry tries one endpoint, x (failed
    longest ago), which now cuts off mid-audio; with audio played, the sentence continues on y,
    sample-exact, instead of failing the retry."""
    x, y = pair
    x.fault = y.fault = "503"
    tts = _tts([x.url, y.url])

    def on_error(_):  # between the attempts: x now cuts mid-audio, y is fine
        x.fault, y.fault = "cut", None

    tts.on("error", on_error)
    conn = APIConnectOptions(max_retry=1, timeout=60.0, retry_interval=0.0)  # no stall here
    try:
        stream = tts.synthesize(SENTENCES[0], conn_options=conn)
        audio = np.concatenate([d async for ev in stream if (d := pcm(ev)) is not None])
    finally:
        await tts.aclose()
    assert stream.attempts == 2 and stream.report.endpoints == [x.url, y.url]
    assert stream.report.skipped_bytes == x.cut_after
    np.testing.assert_array_equal(audio, _pcm(SENTENCES[0], stream.report.seed))


@pytest.mark.parametrize("fault", ["stall_head", "503"])
async def test_fallback_adapter_moves_to_backup_within_conn_timeout(pair, fault):
    """LiveKit's FallbackAdapter over a stalling (or failing) Qwen3-TTS and a healthy one: the
    listener gets the backup's audio, bounded by conn_options.timeout, and the primary is
    reported unavailable."""
    x, y = pair
    x.fault = fault
    primary, backup = _tts([x.url]), _tts([y.url])
    adapter = FallbackAdapter([primary, backup], max_retry_per_tts=0)
    changes = []
    adapter.on("tts_availability_changed", changes.append)
    # the stall is cut by the timeout (x never answers); a 503 needs none
    timeout = STALL_TIMEOUT if fault == "stall_head" else PATIENT.timeout
    conn = APIConnectOptions(max_retry=0, timeout=timeout, retry_interval=0.0)
    loop = asyncio.get_running_loop()
    heard: list[float] = []

    async def on_audio(samples):
        heard.append(loop.time())

    try:
        start = loop.time()
        _, audio = await asyncio.wait_for(
            stream_text(adapter, SENTENCES[:1], conn_options=conn, on_audio=on_audio), WAIT
        )
        print(f"{fault}: the backup's first audio {heard[0] - start:.2f} s after the request")
        # on the loop's clock (LiveKit's timers run on it): a stalled primary is given up on by
        # the timeout, never sooner; how soon after it is the machine's business (WAIT bounds it)
        if fault == "stall_head":
            assert heard[0] - start >= conn.timeout, heard[0] - start
        assert x.inputs()[:1] == SENTENCES[:1] and y.inputs() == SENTENCES[:1]
        np.testing.assert_array_equal(audio, _pcm(SENTENCES[0], y.seen[0]["seed"]))
        assert [(c.tts, c.available) for c in changes] == [(primary, False)]
    finally:
        await adapter.aclose()
        await primary.aclose()
        await backup.aclose()


def _pool_tasks(before: set[asyncio.Task]) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() - before
            if t.get_name().startswith("qwen3-tts-endpoint-") and not t.done()]  # fmt: skip


async def test_aclose_leaves_no_probe_task(pair):
    """Background probes (prewarm, the recovery probes while a stream is open) are all gone after
    aclose, even while a probe is stuck on an endpoint whose /ready stalls; none starts after."""
    x, y = pair
    x.fault, x.ready, x.stall_ready = "503", False, True
    tts = _tts([x.url, y.url])
    before = asyncio.all_tasks()
    await synthesize(tts, "Goes to y after a 503 from x.")  # x is down
    assert _pool_tasks(before) == []  # nothing of the pool outlives the request
    tts.prewarm()
    held = tts.stream()  # open: the pool's keeper runs and probes x, whose /ready stalls
    await _until(lambda: any(t.get_name() == "qwen3-tts-endpoint-probe" for t in _pool_tasks(before))
                 and tts.endpoints.endpoints[0].probed_at > tts.endpoints.endpoints[0].failed_at,
                 "x probed while the stream is open")  # fmt: skip
    tasks = _pool_tasks(before)
    assert any(t.get_name() == "qwen3-tts-endpoint-keeper" for t in tasks)
    await tts.aclose()
    assert all(t.done() for t in tasks)
    assert _pool_tasks(before) == []
    await held.aclose()
    tts.endpoints.mark_down(tts.endpoints.endpoints[1], "after close")
    # The client leaves nothing behind; the loopback servers' connection handlers are theirs.
    leftover = [t for t in asyncio.all_tasks() - before
                if not t.done() and not t.get_coro().__qualname__.startswith("RequestHandler.")]  # fmt: skip
    assert leftover == [], leftover


async def test_aclose_ends_open_streams_and_later_calls_raise(pair):
    """Closing the TTS while a stream plays one sentence and prefetches the next: the stream ends,
    both requests are closed (no task of the plugin is left: the leak fixture), the HTTP client
    is closed, and a later synthesize()/stream() says the TTS is closed. (x sends each request
    part of its audio and then nothing until it stops: neither can end before the close.)"""
    x, _ = pair
    x.fault = "stall_body"
    tts = _tts([x.url], prefetch=1)
    first_audio = asyncio.Event()

    async def on_audio(samples):
        first_audio.set()

    playing = asyncio.create_task(
        stream_text(tts, SENTENCES, on_audio=on_audio, conn_options=PATIENT)
    )
    await asyncio.wait_for(first_audio.wait(), WAIT)
    await _until(lambda: x.inputs() == SENTENCES, "the second sentence's request, prefetched")
    await tts.aclose()
    _, audio = await asyncio.wait_for(playing, WAIT)  # the stream ended, cut short
    assert 0 < len(audio) < len(_pcm(SENTENCES[0], 0)) * 2
    assert tts._client.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        tts.synthesize("Too late.")
    with pytest.raises(RuntimeError, match="closed"):
        tts.stream()
    await tts.aclose()  # twice is fine


@pytest.mark.slow
async def test_real_engine_killed_mid_sentence_without_seed(tiny_checkpoint):
    """The agent's path: no seed configured, so the plugin draws one per sentence and sends it with
    every attempt. Engine a is SIGKILLed mid-sentence; the whole stream equals what the uncut
    engine b says for those seeds."""
    ckpt = tiny_checkpoint("custom_voice")
    # a's steps sleep 500 ms per stream (a fault that only slows; the codes stay): the sentence's
    # last 4 frames take 2 s after its first audio, so the kill lands mid-sentence at any speed
    a = EngineProcess(ckpt, None, "--allow-fault-injection", "--fault-step-delay-ms", "500").start()
    b = EngineProcess(ckpt).start()
    frames = 8
    tts = _tts([a.url, b.url], max_new_tokens=frames, strategy="priority")  # a first (balanced:
    # test_balancing.py kills whichever engine speaks)
    try:
        killed = []

        async def kill_a(samples):
            if not killed and samples >= FRAME_SAMPLES:  # the first sentence plays, from a
                killed.append(samples)
                await asyncio.to_thread(a.kill)

        stream, audio = await asyncio.wait_for(
            stream_text(tts, SENTENCES, on_audio=kill_a, conn_options=REAL_ENGINE), 300
        )
        reports = stream.sentences
        assert killed and reports[0].endpoints == [a.url, b.url] and reports[0].skipped_bytes > 0
        assert reports[-1].endpoints[-1] == b.url
        seeds = [r.seed for r in reports]
        assert None not in seeds and len(set(seeds)) == len(seeds)

        reference = []
        for r in reports:
            uncut = _tts([b.url], max_new_tokens=frames, seed=r.seed)
            try:
                reference.append(await synthesize(uncut, r.text, conn_options=REAL_ENGINE))
            finally:
                await uncut.aclose()
        reference = np.concatenate(reference)
        assert len(audio) == len(reference) == len(SENTENCES) * frames * FRAME_SAMPLES
        np.testing.assert_array_equal(audio, reference)

        # The comparison means something only if another seed gives other audio.
        other = _tts([b.url], max_new_tokens=4, seed=seeds[0] + 1)
        try:
            head = await synthesize(other, reports[0].text, conn_options=REAL_ENGINE)
        finally:
            await other.aclose()
        assert not np.array_equal(head, reference[: len(head)])
    finally:
        await tts.aclose()
        a.stop(), b.stop()
