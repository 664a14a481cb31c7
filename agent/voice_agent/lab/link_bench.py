"""`voice-agent bench link`: first audio on a fresh socket vs a warm one across an emulated link
(JSON). Needs root.

The engine (`qwen3-tts serve`) runs in a network namespace behind a delay line (`delay_line.py`:
every packet RTT/2 late each way, the TCP handshake's too); the TTS plugin speaks to it from
here over its streaming-text socket. Per RTT, N utterances of one sentence on each path,
interleaved (fresh, warm, fresh, ...) after one discarded pair:

- fresh: a new `qwen3_tts.TTS` per utterance: TCP handshake and WebSocket upgrade first;
- warm: one TTS, `prewarm()`ed, every utterance on its pooled socket.

`--rtt-ms 0` measures the delay line's own cost (a user-space forwarder: a few ms here).

Each row: medians of first audio (`TextStreamReport.first_audio_s`: from the text to the first
audio byte, one clock) and of its link share (that minus the engine's own `response.first_audio`
time: what the network and the handshake cost), and the sockets the plugin opened. `compare`, per
RTT: warm over fresh, fresh minus warm in milliseconds and in round trips (a fresh socket should
cost about 2 more: TCP + upgrade), the engine's `qwen3_tts_socket_connections_total` during the
RTT's run (n + 1 fresh, the discarded pair's included, and 1 warm) and the packets forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from livekit.agents import APIConnectOptions
from livekit.plugins import qwen3_tts
from prometheus_client.parser import text_string_to_metric_families

from voice_agent.lab.delay_line import DelayLine

TEXT = "Thanks for calling, how can I help you today?"
PORT = 8880
PATIENT = APIConnectOptions(max_retry=0, timeout=120.0)
READY_TIMEOUT_S = 300.0


def run_link_bench(model: str | None, rtts: list[float], utterances: int, out: Path | None) -> int:
    if utterances < 1 or not rtts or any(not r >= 0 for r in rtts):
        print("voice-agent: error: bench link needs --utterances >= 1 and --rtt-ms values >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if os.geteuid() != 0:
        print("voice-agent: error: bench link needs root (a network namespace and TUN devices)",
              file=sys.stderr)  # fmt: skip
        return 1
    if model is None:
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint  # the lab only

        model = str(default_tiny_checkpoint())
    rows, compare = [], []
    for rtt in rtts:
        print(f"  link: {rtt:g} ms RTT", file=sys.stderr, flush=True)
        with DelayLine(rtt) as line, _engine(line, model) as (url, key):
            fresh, warm, connections = asyncio.run(_measure(url, key, utterances))
        for row in (fresh, warm):
            row["rtt_ms"] = rtt
            rows.append(row)
        # the engine's count includes the discarded pair's fresh socket: n + 1 fresh, 1 warm
        compare.append({**_compare(rtt, fresh, warm), "engine_connections": connections,
                        "packets": line.packets})  # fmt: skip
    result = {"bench": "link", "text": TEXT, "utterances": utterances, "model": model,
              "rows": rows, "compare": compare}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


@contextlib.contextmanager
def _engine(line: DelayLine, model: str) -> Iterator[tuple[str, str]]:
    """`qwen3-tts serve` in the line's namespace, on its far address (with an API key: it is not
    loopback); (its URL, the key) once /ready answers through the line."""
    key = secrets.token_hex(16)
    exe = str(Path(sys.executable).with_name("qwen3-tts"))
    cmd = [exe, "serve", "--model", model, "--host", line.far, "--port", str(PORT),
           "--no-governor"]  # fmt: skip
    proc = subprocess.Popen(line.argv(cmd), stdout=sys.stderr,
                            env={**os.environ, "QWEN3_TTS_API_KEY": key,
                                 "QWEN3_TTS_LOG_LEVEL": "WARNING"})  # fmt: skip
    url = f"http://{line.far}:{PORT}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine on {url} was not ready in {READY_TIMEOUT_S:g} s")
            time.sleep(0.2)
        yield url, key
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _measure(url: str, key: str, n: int) -> tuple[dict, dict, int]:
    """(the fresh row, the warm row, the engine's socket connections during both)."""
    before = await _connections(url)
    warm = _tts(url, key)
    fresh_reports, warm_reports, fresh_opened = [], [], 0
    try:
        warm.prewarm()
        await asyncio.wait_for(warm.sockets.prewarmed(), PATIENT.timeout)
        if not warm.sockets.parked(url):
            raise RuntimeError(f"prewarm() opened no socket to {url} (its log says why)")
        for i in range(n + 1):  # the first pair warms the processes up: not counted
            tts = _tts(url, key)
            try:
                report = await _utter(tts)
            finally:
                await tts.aclose()
            if i:
                fresh_reports.append(report)
                fresh_opened += tts.sockets.opened
            report = await _utter(warm)
            if i:
                warm_reports.append(report)
        warm_opened = warm.sockets.opened
    finally:
        await warm.aclose()
    connections = await _connections(url) - before
    return (_row("fresh", fresh_reports, fresh_opened), _row("warm", warm_reports, warm_opened),
            connections)  # fmt: skip


def _tts(url: str, key: str) -> qwen3_tts.TTS:
    return qwen3_tts.TTS(base_url=url, api_key=key, text_input="stream", voice="ryan",
                         language="en", seed=7, first_chunk_frames=1,
                         timeout=httpx.Timeout(PATIENT.timeout))  # fmt: skip


async def _utter(tts: qwen3_tts.TTS):
    """One utterance of TEXT, all of it at once; its report."""
    stream = tts.stream(conn_options=PATIENT)
    try:
        stream.push_text(TEXT)
        stream.end_input()
        async with asyncio.timeout(PATIENT.timeout):
            async for _ in stream:
                pass
    finally:
        await stream.aclose()
    [report] = stream.text_streams
    if report.first_audio_s is None or report.engine_first_audio_ms is None:
        raise RuntimeError(f"an utterance without audio: {report}")
    return report


def _row(socket: str, reports: list, opened: int) -> dict:
    first = [r.first_audio_s * 1000 for r in reports]
    link = [r.first_audio_s * 1000 - r.engine_first_audio_ms for r in reports]
    return {"socket": socket, "n": len(reports), "first_audio_ms_p50": _median(first),
            "link_ms_p50": _median(link), "engine_first_audio_ms_p50":
            _median([r.engine_first_audio_ms for r in reports]),
            "warm_utterances": sum(1 for r in reports if r.warm), "sockets_opened": opened}  # fmt: skip


def _compare(rtt: float, fresh: dict, warm: dict) -> dict:
    diff = fresh["first_audio_ms_p50"] - warm["first_audio_ms_p50"]
    link_diff = fresh["link_ms_p50"] - warm["link_ms_p50"]
    return {"rtt_ms": rtt,
            "warm_over_fresh": round(warm["first_audio_ms_p50"] / fresh["first_audio_ms_p50"], 3),
            "fresh_minus_warm_ms": round(diff, 1),
            "fresh_minus_warm_rtts": round(diff / rtt, 2) if rtt else None,
            # the link's share alone (the engine's own first-audio time taken out of each)
            "link_fresh_minus_warm_ms": round(link_diff, 1),
            "link_fresh_minus_warm_rtts": round(link_diff / rtt, 2) if rtt else None}  # fmt: skip


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1)


async def _connections(url: str) -> int:
    """The engine's `qwen3_tts_socket_connections_total` of its speech-stream route."""
    async with httpx.AsyncClient(timeout=PATIENT.timeout) as c:
        text = (await c.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "qwen3_tts_socket_connections":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")
                           and s.labels.get("protocol") == "speech_stream"))  # fmt: skip
    return 0
