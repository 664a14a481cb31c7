"""The plugin spreads requests over a fleet of engines (issue 35): the choice itself (pure), then
real engine servers on loopback addresses with different batch sizes.

Streams are held open by not finishing them, at any machine speed: the engines' tiny checkpoint
never ends by EOS (`eos="never"`), an utterance is as long as an engine takes (`LONG`), and its
client lets through its first audio only (`HoldingTransport`, under the plugin; another client
reads none). The engine's flow control then pauses it, so it runs until the test closes it, and
the engine's own `GET /load` shows where each one runs. Engines run without a frame budget
(conftest), so their slots are their `--max-batch` whatever this machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter

import httpx
import numpy as np
import pytest
from livekit.agents import APIConnectOptions
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts.balance import Candidate, pick
from livekit.plugins.qwen3_tts.fleet import Capacity, free_slots
from livekit.plugins.qwen3_tts.protocol import FRAME_SAMPLES
from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig
from qwen3_tts_engine.protocol import Limits, LoadReport
from tests.support.engine_process import EngineProcess, free_port
from tests.support.tts_audio import pcm, synthesize

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
HANG_GUARD_S = 120.0
PATIENT = APIConnectOptions(max_retry=0, timeout=120.0)  # a loaded 2-core machine is no stall
# A held stream's plugin gets no byte after its first audio: only a hang outlasts this timeout.
HELD = APIConnectOptions(max_retry=0, timeout=3600.0)
# frames: the longest utterance an engine takes, 15.7 MB of PCM. A client that stops reading holds
# it: a loopback connection buffers far less unread (about 4 MB: Linux's and macOS's default send
# buffer limit), so the engine's writer waits, its flow control pauses the stream (~1000 frames
# in), and it cannot end before the test closes it, however fast the engine is.
LONG = Limits().max_new_tokens
HELD_BYTES = 96_000  # what a held stream lets through: many times its first audio event
TEXT = "Hold this line for a while."
KILL_MARGIN_MS = 500  # per stream per step, on the engines a test kills mid-sentence


# -- the choice, on given loads ------------------------------------------------------------------


def _load(slots: int, running: int = 0, waiting: int = 0, **kw) -> Capacity:
    return Capacity(running=running, waiting=waiting, slots=slots,
                    free_slots=max(0, slots - running - waiting), **kw)  # fmt: skip


def test_estimated_free_counts_other_clients_as_reported_and_this_one_exactly():
    load = _load(4, running=3)  # 1 of them this client's when the report came
    assert free_slots(load, others_then=2, outstanding=1) == 1
    assert free_slots(load, others_then=2, outstanding=2) == 0  # one more sent since
    assert free_slots(None, 0, 5) is None  # no report: unknown
    for state in ("swapping", "draining", "loading"):
        assert free_slots(_load(4, state=state), 0, 0) == 0
    assert free_slots(_load(4, accepting=False), 0, 0) == 0
    assert free_slots(_load(4, memory_load=1.0), 0, 0) == 0  # at the governor's critical mark


def test_an_engine_with_room_is_taken_before_a_less_used_full_one():
    full = Candidate(order=0, outstanding=0, free=0, slots=1)
    roomy = Candidate(order=1, outstanding=5, free=1, slots=8)
    rng = random.Random(0)
    assert {pick([full, roomy], "balanced", rng).order for _ in range(50)} == {1}
    assert pick([full, roomy], "priority", rng).order == 0  # in order, whatever the load
    # all full: the least overcommitted (it may queue; a 429 moves the request on)
    over = Candidate(order=2, outstanding=3, free=-2, slots=1)
    assert {pick([over, full], "balanced", rng).order for _ in range(50)} == {0}
    # no report: least outstanding, as gRPC's least_request
    a, b = Candidate(0, 2, None), Candidate(1, 1, None)
    assert {pick([a, b], "balanced", rng).order for _ in range(50)} == {1}


def test_power_of_two_choices_spread_clients_with_the_same_view():
    """Many clients that see the same idle fleet do not all pick one engine: ties go either way
    and two random candidates are compared; the busiest engine is never taken while two others
    are less used."""
    idle = [Candidate(i, 0, 4, 4) for i in range(3)]
    picks = Counter(pick(idle, "balanced", random.Random(seed)).order for seed in range(300))
    assert set(picks) == {0, 1, 2} and min(picks.values()) >= 60, picks
    skewed = [Candidate(0, 0, 1, 4), Candidate(1, 0, 3, 4), Candidate(2, 0, 4, 4)]
    picks = Counter(pick(skewed, "balanced", random.Random(seed)).order for seed in range(300))
    assert picks[0] == 0 and picks[2] > picks[1] > 0, picks


# -- real engines ----------------------------------------------------------------------------


async def _engine(model: str, host: str, port: int, max_batch: int, **kw) -> EngineServer:
    retry_after_s = kw.pop("retry_after_s", 2)
    srv = EngineServer(Engine(model, [Handler(model, max_batch=max_batch, frame_budget_s=None, **kw)]),
                       ServerConfig(host=host, port=port, retry_after_s=retry_after_s))  # fmt: skip
    await srv.start()
    return srv


@pytest.fixture(scope="module")
def port() -> int:
    """One port on every loopback address: what a name with several addresses points at."""
    return free_port()


@pytest.fixture(scope="module")
async def fleet(tiny_checkpoint, port):
    """Engines on 127.0.0.1-3, one port, with 2, 4 and 6 slots."""
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    servers = [await _engine(model, f"127.0.0.{i + 1}", port, n) for i, n in enumerate((2, 4, 6))]
    yield servers
    for srv in servers:
        await srv.stop()


def _url(srv: EngineServer) -> str:
    return f"http://{srv.config.host}:{srv.port}"


async def _loads(servers) -> dict[str, LoadReport]:
    """Each engine's own /load (the engine's report: `held` too, which the plugin does not read)."""
    async with httpx.AsyncClient(timeout=30) as client:
        return {_url(s): LoadReport.from_json((await client.get(f"{_url(s)}/load")).json())
                for s in servers}  # fmt: skip


async def _until_loads(servers, what: str, ok) -> dict[str, LoadReport]:
    async with asyncio.timeout(HANG_GUARD_S):
        while not ok(loads := await _loads(servers)):
            await asyncio.sleep(0.05)
    return loads


class _HeldBody(httpx.AsyncByteStream):
    """A speech response's body that ends after `HELD_BYTES` for its reader: the rest waits,
    unread, until the response is closed."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self):
        passed = 0
        async for chunk in self._inner:
            yield chunk
            passed += len(chunk)
            if passed >= HELD_BYTES:
                await asyncio.Event().wait()  # until cancelled: the stream is being closed

    async def aclose(self) -> None:
        await self._inner.aclose()


class HoldingTransport(httpx.AsyncBaseTransport):
    """The plugin's HTTP transport in these tests: speech responses are held after their first
    audio (`_HeldBody`), as a listener that stopped reading would; the rest passes as it is."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.path == "/v1/audio/speech" and response.status_code == 200:
            response.stream = _HeldBody(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _holding_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=HoldingTransport(), timeout=60.0)


class Speaking:
    """A `synthesize()` that has had its first audio and goes on: held (`HoldingTransport`), its
    engine keeps it running until it is closed."""

    def __init__(self, tts: qwen3_tts.TTS, text: str = TEXT) -> None:
        self.stream = tts.synthesize(text, conn_options=HELD)
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for _ in self.stream:
            self.first.set()

    @property
    def endpoint(self) -> str:
        return self.stream.report.endpoints[-1]

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.stream.aclose()


async def _speak_all(tts: qwen3_tts.TTS, n: int) -> list[Speaking]:
    held = [Speaking(tts) for _ in range(n)]
    async with asyncio.timeout(HANG_GUARD_S):
        await asyncio.gather(*(h.first.wait() for h in held))
    return held


async def _close_all(held: list[Speaking]) -> None:
    await asyncio.gather(*(h.aclose() for h in held))


async def test_twelve_streams_fill_three_engines_by_their_slots(fleet):
    """12 at once over engines with 2, 4 and 6 slots: each gets exactly its slots, none queues
    (by the client's record and the engines' own /load), though 12 / 3 would put 4 on each."""
    client = _holding_client()
    tts = qwen3_tts.TTS(base_url=[_url(s) for s in fleet], voice="ryan", language="en",
                        max_new_tokens=LONG, http_client=client)  # fmt: skip
    held = []
    try:
        held = await _speak_all(tts, 12)
        assert Counter(h.endpoint for h in held) == {
            _url(s): n for s, n in zip(fleet, (2, 4, 6), strict=True)
        }
        assert all(h.stream.report.full == [] for h in held)
        loads = await _loads(fleet)
        # a stream its engine's flow control paused (a fast engine gets there) lends its slot:
        # /load counts it `held`, apart from `running`
        assert {u: (lo.running + lo.held, lo.waiting, lo.free_slots - lo.held)
                for u, lo in loads.items()} == {
            _url(s): (n, 0, 0) for s, n in zip(fleet, (2, 4, 6), strict=True)}  # fmt: skip
        assert not any(h.task.done() for h in held)  # all of them ran through the /load read
    finally:
        await _close_all(held)
        await tts.aclose()
        await client.aclose()
    await _until_loads(
        fleet, "all streams ended", lambda ls: all(lo.running + lo.held == 0 for lo in ls.values())
    )


async def test_a_name_with_three_addresses_is_three_engines_and_a_fourth_joins(
    fleet, tiny_checkpoint, port
):
    """`http://tts-fleet.test:P` resolves (by the resolver the test hands the plugin) to the three
    engines' addresses: 12 streams fill them as three engines. A fourth address appears; once
    re-resolved it is used (the only engine with room takes the 13th stream). An address that
    vanishes stays in use for its streams and is dropped when they end."""
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    asked: list[tuple[str, int, tuple[str, ...]]] = []
    changed = asyncio.Event()

    async def resolver(host: str, p: int) -> list[str]:
        asked.append((host, p, tuple(addresses)))
        if len(addresses) != 3:
            changed.set()
        return list(addresses)

    model = str(tiny_checkpoint("custom_voice", eos="never"))
    fourth = await _engine(model, "127.0.0.4", port, 2)
    client = _holding_client()
    tts = qwen3_tts.TTS(base_url=f"http://tts-fleet.test:{port}", voice="ryan", language="en",
                        max_new_tokens=LONG, http_client=client, resolver=resolver,
                        resolve_interval=0.05)  # fmt: skip
    held = []
    try:
        held = await _speak_all(tts, 12)
        assert asked[0][:2] == ("tts-fleet.test", port)
        assert [e.url for e in tts.endpoints.endpoints] == [_url(s) for s in fleet]
        assert Counter(h.endpoint for h in held) == {
            _url(s): n for s, n in zip(fleet, (2, 4, 6), strict=True)
        }

        addresses.append("127.0.0.4")
        async with asyncio.timeout(HANG_GUARD_S):  # the streams hold the pool: it re-resolves
            await changed.wait()
            while len(tts.endpoints.endpoints) < 4:
                await asyncio.sleep(0.02)
        held += await _speak_all(tts, 1)
        assert held[-1].endpoint == _url(fourth)

        changed.clear()
        addresses.remove("127.0.0.1")  # its two streams go on; nothing new goes there
        async with asyncio.timeout(HANG_GUARD_S):
            while not tts.endpoints.endpoints[0].retired:
                await asyncio.sleep(0.02)
        first = [h for h in held if h.endpoint == _url(fleet[0])]
        assert len(first) == 2 and not any(h.task.done() for h in first)
        assert _url(fleet[0]) in [e.url for e in tts.endpoints.endpoints]
        await _close_all(first)
        assert _url(fleet[0]) not in [e.url for e in tts.endpoints.endpoints]
        assert [e.url for e in tts.endpoints.live()] == [_url(s) for s in (*fleet[1:], fourth)]
    finally:
        await _close_all(held)
        await tts.aclose()
        await client.aclose()
        await fourth.stop()
    await _until_loads(
        fleet, "all streams ended", lambda ls: all(lo.running + lo.held == 0 for lo in ls.values())
    )


async def test_localhost_through_the_system_resolver(fleet, port):
    """The real resolver path: `localhost` is the engine on 127.0.0.1 (one IPv4 address, not a
    second engine on ::1, where nothing listens)."""
    tts = qwen3_tts.TTS(base_url=f"http://localhost:{port}", voice="ryan", language="en",
                        max_new_tokens=4, timeout=60.0)  # fmt: skip
    try:
        stream = tts.synthesize("Hello.", conn_options=PATIENT)
        audio = [ev async for ev in stream]
        assert audio and stream.report.endpoints == [_url(fleet[0])]
        assert [e.url for e in tts.endpoints.endpoints] == [_url(fleet[0])]
    finally:
        await tts.aclose()


async def test_a_full_engines_429_goes_to_the_next_engine_and_the_utterance_is_whole(
    fleet, tiny_checkpoint
):
    """Engine a has one slot and one place in its queue, both taken by another client: the
    plugin's request gets a 429 there and is spoken whole by the next engine (the same audio
    that engine gives for the seed); a is not marked down, and is passed over for its
    Retry-After (600 s here: the test never outlives it)."""
    model = str(tiny_checkpoint("custom_voice", eos="never"))
    a = await _engine(model, "127.0.0.1", 0, 1, max_queue=1, retry_after_s=600)
    b = fleet[2]
    tts = qwen3_tts.TTS(base_url=[_url(a), _url(b)], strategy="priority", voice="ryan",
                        language="en", max_new_tokens=8, seed=5, timeout=60.0)  # fmt: skip
    other = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30))
    body = {"input": TEXT, "voice": "ryan", "language": "english", "stream": True,
            "response_format": "pcm", "max_new_tokens": LONG}  # fmt: skip
    opened: list = []

    async def hold() -> None:
        r = await other.send(
            other.build_request("POST", f"{_url(a)}/v1/audio/speech", json=body), stream=True
        )
        opened.append(r)

    holders = [asyncio.create_task(hold())]
    try:
        await _until_loads([a], "one running", lambda ls: next(iter(ls.values())).running == 1)
        holders.append(asyncio.create_task(hold()))  # queued behind it
        await _until_loads([a], "one waiting", lambda ls: next(iter(ls.values())).waiting == 1)

        stream = tts.synthesize(TEXT, conn_options=PATIENT)
        audio = np.concatenate([d async for ev in stream if (d := pcm(ev)) is not None])
        report = stream.report
        assert report.endpoints == [_url(a), _url(b)] and report.full == [_url(a)]
        ep_a = tts.endpoints.endpoints[0]
        assert ep_a.healthy and ep_a.rejections == 1
        reference = qwen3_tts.TTS(base_url=_url(b), voice="ryan", language="en", max_new_tokens=8,
                                  seed=5, timeout=60.0)  # fmt: skip
        try:
            whole = await synthesize(reference, TEXT, conn_options=PATIENT)
        finally:
            await reference.aclose()
        assert len(whole) == 8 * FRAME_SAMPLES
        np.testing.assert_array_equal(audio, whole)

        # within its Retry-After, a is not asked again
        again = tts.synthesize("Once more.", conn_options=PATIENT)
        async for _ in again:
            pass
        assert again.report.endpoints == [_url(b)] and ep_a.requests == 1
    finally:
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        for r in opened:
            await r.aclose()
        await other.aclose()
        await tts.aclose()
        await a.stop()


@pytest.mark.slow
async def test_balanced_engine_killed_mid_sentence_fails_over_sample_exact(tiny_checkpoint):
    """Balanced choice over two engine processes: whichever engine speaks the first sentence is
    SIGKILLed at its first audio; the sentence goes on at the other, and the whole stream equals
    what the survivor says for the same seeds."""
    ckpt = tiny_checkpoint("custom_voice")
    # each step sleeps KILL_MARGIN_MS per stream (a fault that only slows, the codes stay): the
    # sentence's last 4 frames take at least 4 x that after its first audio, so the kill lands
    # mid-sentence at any machine speed (only a 2 s stall of this test's own loop could miss it)
    slow = ("--allow-fault-injection", "--fault-step-delay-ms", str(KILL_MARGIN_MS))
    engines = {
        e.url: e
        for e in (
            EngineProcess(ckpt, None, *slow).start(),
            EngineProcess(ckpt, None, *slow).start(),
        )
    }
    frames = 8
    sentences = ["The first sentence is here.", "Then comes the second one."]
    # the sentence path (the streamed-text path's kill: test_text_stream.py)
    tts = qwen3_tts.TTS(base_url=list(engines), voice="ryan", language="en", max_new_tokens=frames,
                        timeout=60.0, text_input="sentences",
                        first_clause_chunk_frames=None)  # the reference's chunks: sample-equal  # fmt: skip
    try:
        stream = tts.stream(conn_options=PATIENT)
        for s in sentences:
            stream.push_text(s + " ")
        stream.end_input()
        audio, killed = [], []
        async with asyncio.timeout(300):
            async for ev in stream:
                if (data := pcm(ev)) is None:
                    continue
                audio.append(data)
                if not killed and sum(map(len, audio)) >= FRAME_SAMPLES:
                    killed.append(stream.sentences[0].endpoints[-1])
                    await asyncio.to_thread(engines[killed[0]].kill)
        await stream.aclose()
        reports = stream.sentences
        survivor = next(u for u in engines if u != killed[0])
        assert reports[0].endpoints == [killed[0], survivor] and reports[0].skipped_bytes > 0
        assert all(r.endpoints[-1] == survivor for r in reports)
        reference = []
        for r in reports:
            uncut = qwen3_tts.TTS(base_url=survivor, voice="ryan", language="en",
                                  max_new_tokens=frames, seed=r.seed)  # fmt: skip
            try:
                reference.append(await synthesize(uncut, r.text, conn_options=PATIENT))
            finally:
                await uncut.aclose()
        reference = np.concatenate(reference)
        assert (
            len(reference)
            == sum(r.samples for r in reports)
            == len(sentences) * frames * FRAME_SAMPLES
        )
        np.testing.assert_array_equal(np.concatenate(audio), reference)
    finally:
        await tts.aclose()
        for e in engines.values():
            e.stop()
