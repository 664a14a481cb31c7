"""`voice-agent bench fleet`: the plugin's strategies over a fleet of engines on loopback (JSON).

Engines (`qwen3-tts serve`) on 127.0.0.1, 127.0.0.2, ... at one port, each pinned to its own CPU
core (`os.sched_setaffinity` in the child, which its worker processes inherit), so two engines
stand in for two hosts; the plugin sees them as one name that resolves to their addresses (its
discovery, with a resolver the bench controls). The engines keep their real frame budget: their
slots are what each core keeps in real time.

1. `priority` vs `balanced` at the same offered load: M streams arriving one every `--gap` seconds
   (the same schedule for both); per strategy: streams per engine, 429s met, first audio p50/p95
   (from the request to the first chunk), streams lost (an error, or no audio).
2. Churn (balanced): the same arrivals; the first engine is SIGKILLed once a third of the streams
   have started, and a new engine joins (its address appears to the resolver) once two thirds
   have; streams lost must be 0 (the plugin fails over mid-utterance).

Each phase also reports each engine's underruns during it (its `/load` counter: chunks ready
after a listener who started at first audio needed them; None for an engine that is gone).
"""

from __future__ import annotations

import asyncio
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

TEXT = "Thanks for calling, how can I help you today?"
PATIENT = APIConnectOptions(max_retry=0, timeout=120.0)
PIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"


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
    t0 = time.perf_counter()
    stream = tts.synthesize(TEXT, conn_options=PATIENT)
    first, samples = None, 0
    try:
        async for ev in stream:
            started.set()
            if first is None:
                first = time.perf_counter() - t0
            samples += len(ev.frame.data)
    except Exception as e:  # a lost stream: reported, not raised
        return {"lost": f"{type(e).__name__}: {e}"}
    finally:
        started.set()
        await stream.aclose()
    report = stream.report
    return {"first_audio_s": first, "samples": samples, "engine": report.endpoints[-1],
            "endpoints": report.endpoints, "full": report.full, "lost": None if samples else "no audio"}  # fmt: skip


async def _run(tts: qwen3_tts.TTS, streams: int, gap: float, events=None) -> list[dict]:
    """`streams` syntheses, one every `gap` seconds; `events[i]` runs once stream i has audio."""
    tasks = []
    for i in range(streams):
        started = asyncio.Event()
        tasks.append(asyncio.create_task(_one(tts, started)))
        if events and i in events:
            await started.wait()
            await events[i]()
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


async def _underruns(urls: list[str]) -> dict[str, int | None]:
    """Each engine's underrun counter (`GET /load`); None for one that does not answer."""
    out: dict[str, int | None] = {}
    async with httpx.AsyncClient(timeout=30) as c:
        for u in urls:
            try:
                out[u] = int((await c.get(f"{u}/load")).json()["underruns"])
            except (httpx.HTTPError, KeyError, ValueError):
                out[u] = None
    return out


def _delta(before: dict, after: dict) -> dict:
    return {u: None if after.get(u) is None else after[u] - (before.get(u) or 0) for u in after}


def _summary(results: list[dict], urls: list[str]) -> dict:
    ok = [r for r in results if not r["lost"]]
    firsts = [r["first_audio_s"] for r in ok]
    per_engine = Counter(r["engine"] for r in ok)
    fair = len(ok) / max(1, len(urls))
    return {"streams": len(results), "lost": len(results) - len(ok),
            "lost_errors": sorted({r["lost"] for r in results if r["lost"]}),
            "per_engine": {u: per_engine.get(u, 0) for u in urls},
            "share_off_fair_max": max(abs(per_engine.get(u, 0) - fair) / fair for u in urls) if fair else None,
            "rejections_429": sum(len(r["full"]) for r in ok),
            "failovers": sum(len(r["endpoints"]) - 1 - len(r["full"]) for r in ok),
            "first_audio_p50_s": statistics.median(firsts) if firsts else None,
            "first_audio_p95_s": _pct(firsts, 0.95)}  # fmt: skip


async def fleet_bench(model: str, engines: int, streams: int, gap: float, max_batch: int,
                      frames: int) -> dict:  # fmt: skip
    port = _free_port()
    cores = sorted(os.sched_getaffinity(0))
    addresses = [f"127.0.0.{i + 1}" for i in range(engines)]
    live = list(addresses)
    running: list[Engine] = []

    async def resolver(host: str, p: int) -> list[str]:
        return list(live)

    def start(i: int) -> Engine:
        e = Engine(model, f"127.0.0.{i + 1}", port, cores[i % len(cores)], max_batch)
        running.append(e)
        return e

    def tts(strategy: str) -> qwen3_tts.TTS:
        return qwen3_tts.TTS(base_url=f"http://tts-fleet.bench:{port}", strategy=strategy,
                             voice="ryan", language="en", max_new_tokens=frames, timeout=120.0,
                             resolver=resolver, resolve_interval=0.2)  # fmt: skip

    out: dict = {"engines": engines, "streams": streams, "gap_s": gap, "max_batch": max_batch,
                 "frames": frames, "cores": [cores[i % len(cores)] for i in range(engines)]}  # fmt: skip
    try:
        await asyncio.gather(*(start(i).ready() for i in range(engines)))
        urls = [e.url for e in running]
        async with httpx.AsyncClient() as c:
            out["slots"] = {u: (await c.get(f"{u}/load")).json()["slots"] for u in urls}
        for strategy in ("priority", "balanced"):
            t = tts(strategy)
            try:
                before = await _underruns(urls)
                out[strategy] = _summary(await _run(t, streams, gap), urls)
                out[strategy]["underruns"] = _delta(before, await _underruns(urls))
            finally:
                await t.aclose()
        p, b = out["priority"]["first_audio_p95_s"], out["balanced"]["first_audio_p95_s"]
        out["balanced_over_priority_p95"] = b / p if p and b else None

        # churn: kill the first engine a third in, add one two thirds in
        async def kill() -> None:
            live.remove(running[0].address)
            await asyncio.to_thread(running[0].kill)

        async def add() -> None:
            e = start(engines)
            await e.ready()
            live.append(e.address)

        t = tts("balanced")
        try:
            before = await _underruns(urls)
            results = await _run(t, streams, gap, {streams // 3: kill, 2 * streams // 3: add})
        finally:
            await t.aclose()
        out["churn"] = {**_summary(results, [e.url for e in running]),
                        "killed": running[0].url, "added": running[-1].url,
                        "underruns": _delta(before, await _underruns([e.url for e in running]))}  # fmt: skip
        return out
    finally:
        for e in running:
            e.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fleet_bench(model: str | None, engines: int, streams: int, gap: float, max_batch: int,
                    frames: int, out: Path | None) -> int:  # fmt: skip
    if engines < 1 or streams < 3 or gap < 0 or max_batch < 1 or frames < 1:
        print("voice-agent: error: bench fleet needs --engines >= 1, --streams >= 3, --gap >= 0, "
              "--max-batch >= 1, --frames >= 1", file=sys.stderr)  # fmt: skip
        return 2
    if model is None:
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

        model = str(default_tiny_checkpoint())
    result = asyncio.run(fleet_bench(model, engines, streams, gap, max_batch, frames))
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    lost = result["priority"]["lost"] + result["balanced"]["lost"] + result["churn"]["lost"]
    return 1 if lost else 0
