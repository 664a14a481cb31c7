"""`qwen3-tts bench swap`: the governor's variant swaps measured, as JSON, in both swap modes.

Per mode: swap latency (decision -> new variant serving) against the new variant's plain load
time, idle and while an utterance streams; the wait of a request that arrives mid-swap; the
in-flight stream's chunks (none lost or cut; their p95 interval against the same utterance with
no swap, in the comparison); worker memory before, at the peak, and after. `python -m` this
module compares make before break under load with the new worker at the old one's CPU priority
and at the governor's lower one (Governor.loading_nice), repeated. Each request's first audio (the
first chunk) comes with its first audible sample (+ the audio's leading silence).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from qwen3_tts_engine.audio import leading_silence_s
from qwen3_tts_engine.config import EngineConfig, GovernorConfig, build_server
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.governor.governor import LOADING_NICE, Governor, SwapRecord
from qwen3_tts_engine.governor.memory import ManualProbe
from qwen3_tts_engine.governor.policy import BREAK_BEFORE_MAKE, MAKE_BEFORE_BREAK, Policy
from qwen3_tts_engine.models.checkpoints import cache_root
from qwen3_tts_engine.protocol import CHUNK_FRAMES, FRAME_SAMPLES, HEADER_VARIANT
from qwen3_tts_engine.serving.app import ServerConfig
from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint

LONG_FRAMES = 48  # the utterance that is speaking while the swap happens (12 chunks, ~2 s of
# synthesis here: it overlaps the new worker's start-up, load and warm-up)
SHORT_FRAMES = 4
MID_SWAP_DELAY_S = 0.3  # the second request arrives this long after the decision
TEXT = "A voice that keeps talking while the engine changes its precision underneath."
MB = 1 << 20


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


class _Stream:
    def __init__(self, url: str, frames: int, seed: int, voice: str | None) -> None:
        self.frames = frames
        self.body = {"input": TEXT, "voice": voice, "language": "en", "seed": seed,
                     "max_new_tokens": frames, "stream": True, "response_format": "pcm"}  # fmt: skip
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.bytes = 0
        self.pcm = bytearray()
        self.variant: str | None = None
        self.error: str | None = None
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._run(url))

    async def _run(self, url: str) -> None:
        try:
            async with httpx.AsyncClient(timeout=600) as c, \
                    c.stream("POST", url, json=self.body) as r:  # fmt: skip
                self.variant = r.headers.get(HEADER_VARIANT)
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                async for data in r.aiter_raw():
                    self.bytes += len(data)
                    self.pcm += data
                    self.times.append(time.perf_counter())
                    self.first.set()
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        self.first.set()

    @property
    def first_audio_s(self) -> float | None:
        return self.times[0] - self.t0 if self.times else None

    @property
    def first_audible_s(self) -> float | None:
        """The first chunk + the audio's leading silence (`audio.leading_silence_s`)."""
        if not self.times:
            return None
        return self.first_audio_s + leading_silence_s(bytes(self.pcm[: len(self.pcm) // 2 * 2]))

    def report(self) -> dict:
        expected = self.frames * FRAME_SAMPLES * 2
        chunk = CHUNK_FRAMES * FRAME_SAMPLES * 2
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return {"variant": self.variant, "error": self.error, "bytes": self.bytes,
                "complete": self.bytes == expected and self.error is None,
                "lost_chunks": max(0, -(-(expected - self.bytes) // chunk)),
                "first_audio_s": self.first_audio_s, "first_audible_s": self.first_audible_s,
                "max_chunk_gap_s": max(gaps) if gaps else None,
                "p95_chunk_gap_s": _p95(gaps),
                "median_chunk_gap_s": statistics.median(gaps) if gaps else None,
                "chunk_gaps_s": [round(g, 4) for g in gaps]}  # fmt: skip


async def _plain_load(model: str, variant: str) -> float:
    h = Handler(model, variant)
    try:
        return (await h.start())["start_s"]
    finally:
        await h.stop(drain=False)


async def _workers_rss(engine: Engine) -> int:
    total = 0
    for h in engine.all_handlers():
        if h.state != "stopped":
            total += (await h.memory()).get("rss_bytes", 0)
    return total


async def _sample_peak(engine: Engine, stop: asyncio.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(await _workers_rss(engine))
        await asyncio.sleep(0.05)


def _memory_mb(rec: SwapRecord, peak: int) -> dict:
    b, a = rec.memory_before or {}, rec.memory_after or {}

    def mb(v):
        return round(v / MB, 1) if v else None

    return {"active_worker_before": mb(b.get("active_rss_bytes")),
            "active_worker_after": mb(a.get("active_rss_bytes")),
            "workers_before": mb(b.get("workers_rss_bytes")), "workers_peak": mb(peak),
            "workers_after": mb(a.get("workers_rss_bytes"))}  # fmt: skip


async def _swap(gov: Governor, variant: str, mode: str) -> tuple[SwapRecord, int]:
    """A swap measured to the end of the old worker; returns the record and the peak RSS."""
    stop, samples = asyncio.Event(), []
    sampler = asyncio.create_task(_sample_peak(gov.engine, stop, samples))
    rec = await gov.request(variant, mode=mode)
    await gov.settle()  # make-before-break retires the old worker after the swap
    stop.set()
    await sampler
    return rec, max(samples, default=0)


def _timing(rec: SwapRecord, plain_load_s: float) -> dict:
    # Break before make first waits for the utterance in flight: that wait is by design.
    drain = rec.drain_s if rec.mode == BREAK_BEFORE_MAKE else 0.0
    return {"from": rec.from_variant, "to": rec.to_variant, "latency_s": rec.latency_s,
            "drain_s": rec.drain_s, "stop_s": rec.stop_s, "load_in_swap_s": rec.load_s,
            "plain_load_s": plain_load_s,
            "latency_minus_drain_minus_plain_load_s": rec.latency_s - drain - plain_load_s,
            "machinery_overhead_s": rec.latency_s - drain - (rec.load_s or 0.0)}  # fmt: skip


async def _mode(model: str, mode: str, plain: dict[str, float], loading_nice: int = LOADING_NICE,
                idle_reference: bool = False, spare_worker: bool = False) -> dict:  # fmt: skip
    governor = GovernorConfig(
        Policy(ladder=("bf16", "8bit")),
        probe=ManualProbe(),
        auto=False,
        allow_unevaluated=("all",),
        spare_worker=spare_worker,
    )  # swaps, not quality
    # no frame budget: the streams all run together whatever this machine's speed
    server = build_server(EngineConfig(model, variants=("bf16",), server=ServerConfig(port=0),
                                       governor=governor, frame_budget_s=None))  # fmt: skip
    gov, engine = server.governor, server.engine
    gov.loading_nice = loading_nice
    await server.start()
    if gov._spare is not None:  # its start-up is not part of what is measured
        await asyncio.to_thread(gov._spare.wait_ready, 120)
    url = f"http://127.0.0.1:{server.port}/v1/audio/speech"
    voice = (engine.info.get("voices") or [None])[0]
    try:
        baseline = _Stream(url, SHORT_FRAMES, 1, voice)
        await baseline.task
        idle_gaps: dict = {}
        if idle_reference:  # the same traffic with no swap: the long utterance, and the short
            # request arriving as the mid-swap one does (it shares the worker with the long one)
            idle_stream = _Stream(url, LONG_FRAMES, 2, voice)
            await idle_stream.first.wait()
            await asyncio.sleep(MID_SWAP_DELAY_S)
            idle_mid = _Stream(url, SHORT_FRAMES, 3, voice)
            await asyncio.gather(idle_stream.task, idle_mid.task)
            idle_gaps = idle_stream.report()
        # Down while an utterance streams; a second request arrives in the middle of the swap.
        speaking = _Stream(url, LONG_FRAMES, 2, voice)
        await speaking.first.wait()
        swap = asyncio.create_task(_swap(gov, "8bit", mode))
        await asyncio.sleep(MID_SWAP_DELAY_S)
        mid = _Stream(url, SHORT_FRAMES, 3, voice)
        rec, peak = await swap
        await asyncio.gather(speaking.task, mid.task)
        mid_report = mid.report()
        mid_report["arrived_after_decision_s"] = MID_SWAP_DELAY_S
        mid_report["extra_wait_s"] = (mid.first_audio_s or 0) - (baseline.first_audio_s or 0)
        streaming = speaking.report()
        if idle_gaps.get("p95_chunk_gap_s"):
            streaming["chunk_gap_p95_vs_idle"] = (
                streaming["p95_chunk_gap_s"] / idle_gaps["p95_chunk_gap_s"]
            )
        loaded = {**_timing(rec, plain["8bit"]), "in_flight_stream": streaming,
                  "mid_swap_request": mid_report, "memory_mb": _memory_mb(rec, peak),
                  **({"idle_stream": idle_gaps} if idle_gaps else {})}  # fmt: skip
        # Up again with no traffic: the swap's latency against the plain load time.
        rec, peak = await _swap(gov, "bf16", mode)
        idle = {**_timing(rec, plain["bf16"]), "memory_mb": _memory_mb(rec, peak)}
        return {"loading_nice": loading_nice if mode == MAKE_BEFORE_BREAK else None,
                "baseline_first_audio_s": baseline.first_audio_s,
                "baseline_first_audible_s": baseline.first_audible_s, "under_load": loaded,
                "idle": idle, "requests": [baseline.report(), streaming, mid_report,
                                           *([idle_gaps] if idle_gaps else [])]}  # fmt: skip
    finally:
        await server.stop()


def run_swap_bench(args) -> int:
    model = _model(args.model)
    print(f"swap benchmark on {model} ...", file=sys.stderr)

    async def run() -> dict:
        await _plain_load(model, "8bit")  # quantize-on-load once, so every load is a plain load
        plain = {v: statistics.median([await _plain_load(model, v) for _ in range(args.plain_loads)])
                 for v in ("bf16", "8bit")}  # fmt: skip
        modes = {}
        for mode in (MAKE_BEFORE_BREAK, BREAK_BEFORE_MAKE):
            print(f"  {mode}", file=sys.stderr)
            modes[mode] = await _mode(model, mode, plain)
        return {"plain_load_s": plain, "modes": modes}

    result = asyncio.run(run())
    requests = [r for m in result["modes"].values() for r in m.pop("requests")]
    cases = {f"{mode} {case}": m[case] for mode, m in result["modes"].items()
             for case in ("under_load", "idle")}  # fmt: skip
    report = {
        "model": model, "tiny_checkpoint": not args.model, "long_frames": LONG_FRAMES,
        "short_frames": SHORT_FRAMES, **result,
        "lost_chunks": sum(r["lost_chunks"] for r in requests),
        "truncated_or_failed_requests": sum(not r["complete"] for r in requests),
        "goal": {
            "latency_within_plain_load_plus_100ms": {
                name: c["latency_minus_drain_minus_plain_load_s"] <= 0.1 for name, c in cases.items()},
            "machinery_overhead_under_100ms": {
                name: c["machinery_overhead_s"] <= 0.1 for name, c in cases.items()},
            "zero_lost_or_truncated_chunks": all(r["complete"] for r in requests),
        },
    }  # fmt: skip
    text = json.dumps(report, indent=2, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _model(path: str | None) -> str:

    model = path or str(cache_root() / "tiny" / "custom_voice-8layers-seed0")
    if not path and not (Path(model) / "config.json").is_file():
        write_tiny_checkpoint(model, variant="custom_voice", seed=0, talker_layers=8)
    return model


def run_nice_comparison(
    model: str | None, repeats: int, nices: tuple[int, ...], spare: bool = False
) -> dict:
    """Make before break under load, per loading niceness: swap latency minus plain load, the
    in-flight stream's p95 chunk interval against the same utterance with no swap, chunks lost."""
    model = _model(model)

    async def run() -> dict:
        await _plain_load(model, "8bit")
        plain = {v: statistics.median([await _plain_load(model, v) for _ in range(2)])
                 for v in ("bf16", "8bit")}  # fmt: skip
        runs: dict[str, list] = {str(n): [] for n in nices}
        gaps: dict[str, dict[str, list[float]]] = {str(n): {"swap": [], "idle": []} for n in nices}
        for i in range(repeats):
            for n in nices:  # interleaved: the machine's other load hits both alike
                print(f"  make-before-break, loading nice {n}, run {i + 1}", file=sys.stderr)
                m = await _mode(
                    model, MAKE_BEFORE_BREAK, plain, n, idle_reference=True, spare_worker=spare
                )
                u = m["under_load"]
                runs[str(n)].append(entry := {
                    "latency_minus_plain_load_s": u["latency_minus_drain_minus_plain_load_s"],
                    "load_in_swap_s": u["load_in_swap_s"],
                    "chunk_gap_p95_vs_idle": u["in_flight_stream"].get("chunk_gap_p95_vs_idle"),
                    "in_flight_p95_chunk_gap_s": u["in_flight_stream"]["p95_chunk_gap_s"],
                    "idle_p95_chunk_gap_s": u["idle_stream"]["p95_chunk_gap_s"],
                    "lost_chunks": sum(r["lost_chunks"] for r in m["requests"]),
                    "incomplete": sum(not r["complete"] for r in m["requests"]),
                })  # fmt: skip
                print(f"    {json.dumps(entry, default=float)}", file=sys.stderr, flush=True)
                gaps[str(n)]["swap"] += u["in_flight_stream"]["chunk_gaps_s"]
                gaps[str(n)]["idle"] += u["idle_stream"]["chunk_gaps_s"]
        # every interval of every run together: one run's p95 of 11 intervals is its worst one
        pooled = {n: {"swap_p95_chunk_gap_s": _p95(g["swap"]), "idle_p95_chunk_gap_s": _p95(g["idle"]),
                      "chunk_gap_p95_vs_idle": (_p95(g["swap"]) or 0) / (_p95(g["idle"]) or 1),
                      "intervals": len(g["swap"])} for n, g in gaps.items()}  # fmt: skip
        return {"plain_load_s": plain, "runs": runs, "pooled": pooled}

    result = asyncio.run(run())
    result["median"] = {n: {k: statistics.median(r[k] for r in rs if r[k] is not None)
                            for k in rs[0]} for n, rs in result["runs"].items()}  # fmt: skip
    return {"model": model, "long_frames": LONG_FRAMES, "spare_worker": spare, **result}


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description=run_nice_comparison.__doc__)
    p.add_argument("--model")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nices", default=f"0,{LOADING_NICE}")
    p.add_argument("--spare", action="store_true", help="the governor keeps a spare worker")
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = run_nice_comparison(args.model, args.repeats, tuple(int(n) for n in args.nices.split(",")),
                                 args.spare)  # fmt: skip
    text = json.dumps(report, indent=2, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
