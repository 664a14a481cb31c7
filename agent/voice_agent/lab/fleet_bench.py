"""`voice-agent bench fleet`: the plugin's strategies over a fleet of engines on loopback (JSON).

Engines (`qwen3-tts serve`) on 127.0.0.1, 127.0.0.2, ... at one port, each pinned to its own CPU
core (`os.sched_setaffinity` in the child, which its worker processes inherit), so two engines
stand in for two hosts; the plugin sees them as one name that resolves to their addresses (its
discovery, with a resolver the bench controls). The engines keep their real frame budget: their
slots are what each core keeps in real time, as each engine measures its own steps.

Two configurations, the text as an agent sends it (`tts.stream()`, one reply each): `sentences`
(`text_input="sentences"`: one HTTP request per sentence, the first clause ahead) and `stream`
(the plugin's default `text_input`, streamed text over the engine's WebSocket where the engine
takes it). Each configuration runs `--runs` times on a fresh fleet, the configurations
interleaved; each run has these phases:

0. Solo: three replies one after another (priority): one reply's time in the fleet alone, S.
1. `priority` vs `balanced` at the same offered load: M streams arriving one every `--gap` seconds
   (the same schedule for both); per strategy: streams per engine, 429s met, first audio and
   first audible p50/p95 (from the request to the first chunk, and + the audio's leading silence,
   as Coval's TTS benchmark counts it), streams lost (an error, or no audio); by Little's law, the
   offered load in streams at once (S ÷ `--gap`) and what the balanced fleet held (its mean time
   in the fleet ÷ `--gap`, queueing included).
2. Churn (balanced): the same arrivals; the first engine is SIGKILLed once a third of the streams
   have started, and a new engine joins (its address appears to the resolver) once two thirds
   have; streams lost must be 0 (the plugin fails over mid-utterance).

With `--loads` (a sweep, e.g. `0.5,1.2,1.5,1.8`), phases 1-2 are replaced by one priority /
balanced pair per load: the load is a multiple of one engine's slots (its `/load` after the solo
phase), offered as streams at once by Little's law: `--gap` = S ÷ (load × slots), S measured
again (three replies alone) just before each load's pair. Per load and
configuration the report has the spread of balanced ÷ priority p95 and of the offered load.

Each phase starts once every engine's `/load` says nothing runs or waits (the previous phase's
tail neither slows it nor shows in its plugin's first load reports). Each phase also reports
each engine's underruns during it and its `slots`, polled from `/load`
during the traffic (the most seen) and read after it (None for an engine that is gone). Per
configuration: the spread (min / median / max) of balanced ÷ priority first-audio p95 over the
runs, against the goal (<= 0.6 in every run, 0 lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from livekit.agents import APIConnectOptions
from livekit.plugins import qwen3_tts

from qwen3_tts_engine.audio import leading_silence_s

TEXT = "Thanks for calling, how can I help you today?"
PATIENT = APIConnectOptions(max_retry=0, timeout=120.0)
PIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"
PATHS = {"sentences": "sentences", "stream": None}  # configuration -> text_input (None: default)
GOAL_RATIO = 0.6  # balanced ÷ priority first-audio p95, in every run
POLL_S = 0.25  # how often `/load` is read during a phase


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else None


class Engine:
    """One `qwen3-tts serve` on its own loopback address and CPU core."""

    def __init__(self, model: str, address: str, port: int, core: int, max_batch: int) -> None:
        self.address, self.port, self.core = address, port, core
        exe = Path(sys.executable).with_name("qwen3-tts")
        args = ["serve", "--model", model, "--host", address, "--port", str(port),
                "--max-batch", str(max_batch), "--no-governor"]  # fmt: skip
        self.proc = subprocess.Popen(
            # pinned before exec (the worker processes it starts inherit the core); no
            # preexec_fn, which is unsafe once the bench has threads
            [sys.executable, "-c", PIN, str(core), str(exe), *args],
            env={**os.environ, "QWEN3_TTS_LOG_LEVEL": "WARNING", "QWEN3_TTS_FRAME_BUDGET_MS": "80"},
            start_new_session=True,
            stdout=sys.stderr,  # stdout is the JSON report alone
        )

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    async def ready(self, timeout: float = 300.0) -> Engine:
        async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine on {self.url} exited with {self.proc.returncode}")
                try:
                    if (await client.get(f"{self.url}/ready", timeout=2)).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


async def _one(tts: qwen3_tts.TTS, started: asyncio.Event) -> dict:
    """One reply through `tts.stream()`: its text pushed at once, as an LLM that is ahead."""
    t0 = time.perf_counter()
    stream = tts.stream(conn_options=PATIENT)
    stream.push_text(TEXT)
    stream.end_input()
    first, pcm, rate = None, bytearray(), qwen3_tts.SAMPLE_RATE
    try:
        async for ev in stream:
            started.set()
            if first is None:
                first = time.perf_counter() - t0
            pcm += bytes(ev.frame.data)
            rate = ev.frame.sample_rate
    except Exception as e:  # a lost stream: reported, not raised
        return {"lost": f"{type(e).__name__}: {e}"}
    finally:
        started.set()
        await stream.aclose()
    total = time.perf_counter() - t0
    reports = stream.text_streams or stream.sentences  # the path its text took
    if not pcm or not reports:
        return {"lost": "no audio"}
    return {"first_audio_s": first, "first_audible_s": first + leading_silence_s(bytes(pcm), rate),
            "total_s": total, "samples": len(pcm) // 2, "text_streamed": bool(stream.text_streams),
            "engine": reports[0].endpoints[-1],  # the engine that finished its first request
            "requests": [{"endpoints": r.endpoints, "full": r.full} for r in reports], "lost": None}  # fmt: skip


async def _run(tts: qwen3_tts.TTS, streams: int, gap: float, events=None) -> list[dict]:
    """`streams` replies, one every `gap` seconds; `events[i]` runs once stream i has audio."""
    tasks = []
    for i in range(streams):
        started = asyncio.Event()
        tasks.append(asyncio.create_task(_one(tts, started)))
        if events and i in events:
            await started.wait()
            await events[i]()
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


async def _loads(client: httpx.AsyncClient, urls: list[str]) -> dict[str, dict | None]:
    """Each engine's `GET /load`; None for one that does not answer."""

    async def one(u: str) -> dict | None:
        try:
            return (await client.get(f"{u}/load")).raise_for_status().json()
        except (httpx.HTTPError, ValueError):
            return None

    return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))


async def _until_idle(client: httpx.AsyncClient, urls: list[str], timeout: float = 300.0) -> None:
    """Until every engine's `/load` says nothing runs or waits: each phase starts from a quiet
    fleet, and its fresh plugin's first load reports are not the previous phase's tail."""
    async with asyncio.timeout(timeout):
        while True:
            loads = await _loads(client, urls)
            if all(lo is not None and lo["running"] + lo["waiting"] == 0 for lo in loads.values()):
                return
            await asyncio.sleep(POLL_S)


class LoadWatch:
    """`/load` of the engines around one phase: underruns over it, slots during and after."""

    def __init__(self, client: httpx.AsyncClient, urls) -> None:
        self.client, self.urls = client, urls  # urls(): the engines now
        self.before: dict[str, dict | None] = {}
        self.slots_max: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LoadWatch:
        self.before = await _loads(self.client, self.urls())
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _poll(self) -> None:
        while not self._stop.is_set():
            for u, load in (await _loads(self.client, self.urls())).items():
                if load is not None and "slots" in load:
                    self.slots_max[u] = max(self.slots_max.get(u, 0), int(load["slots"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), POLL_S)

    async def report(self, urls: list[str]) -> dict:
        """After the traffic: each engine's slots now, the most seen during it, its underruns."""
        after = await _loads(self.client, urls)

        def underruns(u: str) -> int | None:
            if after[u] is None:
                return None
            return int(after[u]["underruns"]) - int((self.before.get(u) or {}).get("underruns", 0))

        return {"slots_after": {u: None if a is None else a["slots"] for u, a in after.items()},
                "slots_max_during": {u: self.slots_max.get(u) for u in urls},
                "underruns": {u: underruns(u) for u in urls}}  # fmt: skip


def _summary(results: list[dict], urls: list[str]) -> dict:
    ok = [r for r in results if not r["lost"]]
    firsts = [r["first_audio_s"] for r in ok]
    audible = [r["first_audible_s"] for r in ok]
    requests = [q for r in ok for q in r["requests"]]
    per_engine = Counter(r["engine"] for r in ok)
    fair = len(ok) / max(1, len(urls))
    return {"streams": len(results), "lost": len(results) - len(ok),
            "lost_errors": sorted({r["lost"] for r in results if r["lost"]}),
            "text_streamed": sum(r["text_streamed"] for r in ok),
            "per_engine": {u: per_engine.get(u, 0) for u in urls},
            "share_off_fair_max": max(abs(per_engine.get(u, 0) - fair) / fair for u in urls) if fair else None,
            "rejections_429": sum(len(q["full"]) for q in requests),
            "failovers": sum(len(q["endpoints"]) - 1 - len(q["full"]) for q in requests),
            "first_audio_p50_s": statistics.median(firsts) if firsts else None,
            "first_audio_p95_s": _pct(firsts, 0.95),
            "first_audible_p50_s": statistics.median(audible) if audible else None,
            "first_audible_p95_s": _pct(audible, 0.95),
            "mean_time_in_fleet_s": statistics.fmean(r["total_s"] for r in ok) if ok else None,
            "audio_s_p50": statistics.median(r["samples"] for r in ok) / qwen3_tts.SAMPLE_RATE if ok else None}  # fmt: skip


async def fleet_run(model: str, text_input: str | None, engines: int, streams: int, gap: float,
                    max_batch: int, frames: int, loads: tuple[float, ...] = ()) -> dict:  # fmt: skip
    """One run on a fresh fleet: priority, balanced, then churn; with `loads`, a priority /
    balanced pair per load (multiples of one engine's slots) and no churn."""
    port = _free_port()
    cores = sorted(os.sched_getaffinity(0))
    live = [f"127.0.0.{i + 1}" for i in range(engines)]
    running: list[Engine] = []

    async def resolver(host: str, p: int) -> list[str]:
        return list(live)

    def start(i: int) -> Engine:
        e = Engine(model, f"127.0.0.{i + 1}", port, cores[i % len(cores)], max_batch)
        running.append(e)
        return e

    def tts(strategy: str) -> qwen3_tts.TTS:
        options = {} if text_input is None else {"text_input": text_input}
        return qwen3_tts.TTS(base_url=f"http://tts-fleet.bench:{port}", strategy=strategy,
                             voice="ryan", language="en", max_new_tokens=frames, timeout=120.0,
                             resolver=resolver, resolve_interval=0.2, **options)  # fmt: skip

    def urls() -> list[str]:
        return [e.url for e in running if e.address in live]

    out: dict = {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        await asyncio.gather(*(start(i).ready() for i in range(engines)))
        fleet = [e.url for e in running]
        async with httpx.AsyncClient(timeout=30) as client:
            # one reply's time in the fleet alone (3, one after another): the offered load below
            await _until_idle(client, fleet)
            t = tts("priority")
            try:
                solo = [(await _run(t, 1, 0.0))[0] for _ in range(3)]
            finally:
                await t.aclose()
            out["solo"] = _summary(solo, fleet)
            solo_s = out["solo"]["mean_time_in_fleet_s"]

            async def pair(gap: float, solo_s: float | None = solo_s) -> dict:
                """Priority then balanced at one offered load (`gap`), and what they give."""
                res: dict = {}
                for strategy in ("priority", "balanced"):
                    await _until_idle(client, fleet)
                    t = tts(strategy)
                    try:
                        async with LoadWatch(client, urls) as watch:
                            results = await _run(t, streams, gap)
                    finally:
                        await t.aclose()
                    res[strategy] = {**_summary(results, fleet), **await watch.report(fleet)}
                p, b = res["priority"]["first_audio_p95_s"], res["balanced"]["first_audio_p95_s"]
                res["balanced_over_priority_p95"] = b / p if p and b else None
                # Little's law (streams at once = arrival rate x time in the fleet): offered, by
                # one reply's time alone; held by the balanced fleet, queueing included
                w = res["balanced"]["mean_time_in_fleet_s"]
                res["offered_streams_at_once"] = (
                    solo_s / gap if solo_s is not None and gap > 0 else None
                )
                res["balanced_streams_at_once"] = w / gap if w is not None and gap > 0 else None
                return res

            if loads:  # the sweep: each load a multiple of one engine's slots after the solo
                after = await _loads(client, fleet)
                one = max([int(lo["slots"]) for lo in after.values() if lo] or [1])
                out["one_engine_slots"], out["sweep"] = one, {}
                for load in loads:
                    # S again just before: a shared machine's speed moves within minutes
                    await _until_idle(client, fleet)
                    t = tts("priority")
                    try:
                        s = _summary([(await _run(t, 1, 0.0))[0] for _ in range(3)], fleet)
                    finally:
                        await t.aclose()
                    s_now = s["mean_time_in_fleet_s"] or solo_s
                    g = s_now / (load * one) if s_now else gap
                    out["sweep"][f"{load:g}"] = {"load": load, "solo_s": s_now, "gap_s": g,
                                                 **await pair(g, s_now)}  # fmt: skip
                return out
            out.update(await pair(gap))
            # the goal's load: past one engine's slots (after the traffic), within the fleet's
            slots = [n for n in out["balanced"]["slots_after"].values() if n is not None]
            offered = out["offered_streams_at_once"]
            out["past_one_engine_within_all"] = (
                None if offered is None or not slots else max(slots) < offered <= sum(slots)
            )

            # churn: kill the first engine a third in, add one two thirds in
            async def kill() -> None:
                live.remove(running[0].address)
                await asyncio.to_thread(running[0].kill)

            async def add() -> None:
                e = start(engines)
                await e.ready()
                live.append(e.address)

            await _until_idle(client, fleet)
            t = tts("balanced")
            try:
                async with LoadWatch(client, urls) as watch:
                    results = await _run(
                        t, streams, gap, {streams // 3: kill, 2 * streams // 3: add}
                    )
            finally:
                await t.aclose()
            every = [e.url for e in running]
            out["churn"] = {**_summary(results, every), "killed": running[0].url,
                            "added": running[-1].url, **await watch.report(every)}  # fmt: skip
        return out
    finally:
        for e in running:
            e.stop()


def _spread(xs: list[float | None]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


async def fleet_bench(model: str, engines: int, streams: int, gap: float, max_batch: int,
                      frames: int, runs: int = 3, paths: tuple[str, ...] = tuple(PATHS),
                      loads: tuple[float, ...] = ()) -> dict:  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    out: dict = {"engines": engines, "streams": streams, "gap_s": gap, "max_batch": max_batch,
                 "frames": frames, "runs": runs, "cores": [cores[i % len(cores)] for i in range(engines)],
                 "nproc": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                 "goal": {"balanced_over_priority_p95_max": GOAL_RATIO, "lost": 0},
                 "configurations": {p: {"text_input": PATHS[p] or "default", "runs": []} for p in paths}}  # fmt: skip
    for r in range(runs):  # interleaved: the machine's other load weighs on both alike
        for p in paths:
            print(f"  fleet: {p}, run {r + 1} of {runs}", file=sys.stderr, flush=True)
            out["configurations"][p]["runs"].append(
                await fleet_run(model, PATHS[p], engines, streams, gap, max_batch, frames, loads)
            )
    if loads:
        return _sweep_summary(out, loads)
    for c in out["configurations"].values():
        ratios = [run["balanced_over_priority_p95"] for run in c["runs"]]
        c["balanced_over_priority_p95"] = _spread(ratios)
        for key in ("offered_streams_at_once", "balanced_streams_at_once"):
            c[key] = _spread([run[key] for run in c["runs"]])
        c["lost"] = sum(
            run[ph]["lost"] for run in c["runs"] for ph in ("solo", "priority", "balanced", "churn")
        )
        c["goal_met_every_run"] = c["lost"] == 0 and all(
            x is not None and x <= GOAL_RATIO for x in ratios
        )
    return out


def _sweep_summary(out: dict, loads: tuple[float, ...]) -> dict:
    """Per configuration and load: the spread over runs of balanced ÷ priority p95 and of the
    offered load; the goal: <= 0.6 past one engine (load > 1), within noise of 1 below it."""
    out["loads"] = list(loads)
    out["goal"] = {"past_one_engine": f"balanced/priority p95 <= {GOAL_RATIO}",
                   "below_one_engine": "within noise of 1", "lost": 0}  # fmt: skip
    for c in out["configurations"].values():
        c["sweep"] = {}
        for load in loads:
            rows = [run["sweep"][f"{load:g}"] for run in c["runs"]]
            ratios = [r["balanced_over_priority_p95"] for r in rows]
            c["sweep"][f"{load:g}"] = {
                "balanced_over_priority_p95": _spread(ratios),
                "offered_streams_at_once": _spread([r["offered_streams_at_once"] for r in rows]),
                "lost": sum(r[ph]["lost"] for r in rows for ph in ("priority", "balanced")),
                "goal_met_every_run": None if load <= 1 else all(
                    x is not None and x <= GOAL_RATIO for x in ratios),
            }  # fmt: skip
        c["lost"] = sum(v["lost"] for v in c["sweep"].values()) + sum(
            run["solo"]["lost"] for run in c["runs"]
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fleet_bench(model: str | None, engines: int, streams: int, gap: float, max_batch: int,
                    frames: int, out: Path | None, runs: int = 3,
                    paths: tuple[str, ...] = tuple(PATHS), loads: tuple[float, ...] = ()) -> int:  # fmt: skip
    if engines < 1 or streams < 3 or gap < 0 or max_batch < 1 or frames < 1 or runs < 1:
        print("voice-agent: error: bench fleet needs --engines >= 1, --streams >= 3, --gap >= 0, "
              "--max-batch >= 1, --frames >= 1, --runs >= 1", file=sys.stderr)  # fmt: skip
        return 2
    if any(x <= 0 for x in loads):
        print("voice-agent: error: --loads takes positive multiples of one engine's slots",
              file=sys.stderr)  # fmt: skip
        return 2
    if not paths or set(paths) - set(PATHS):
        print(f"voice-agent: error: --paths takes {', '.join(PATHS)}", file=sys.stderr)
        return 2
    if model is None:
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

        model = str(default_tiny_checkpoint())
    result = asyncio.run(
        fleet_bench(model, engines, streams, gap, max_batch, frames, runs, paths, loads)
    )
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 1 if any(c["lost"] for c in result["configurations"].values()) else 0
