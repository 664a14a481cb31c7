"""The governor swapping real handlers (tiny checkpoints, worker processes) under an injected
memory probe, with real HTTP on 127.0.0.1: no chunk lost, no request failed, the right variant."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx
import psutil
import pytest

from qwen3_tts_engine.cli import main as cli_main
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler, Result
from qwen3_tts_engine.governor.governor import Governor
from qwen3_tts_engine.governor.memory import ManualProbe
from qwen3_tts_engine.governor.policy import BREAK_BEFORE_MAKE, MAKE_BEFORE_BREAK, Policy
from qwen3_tts_engine.priority import can_raise_priority, renice
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    HEADER_VARIANT,
    Limits,
    parse_speech_request,
)
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

pytestmark = pytest.mark.slow
API_KEY = "governor-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GB = 1 << 30
LADDER = ("bf16", "8bit", "4bit")


def body(frames: int, seed: int = 1, stream: bool = True) -> dict:
    return {"input": "Hello from the governor test.", "voice": "ryan", "language": "en",
            "seed": seed, "max_new_tokens": frames, "stream": stream, "response_format": "pcm"}  # fmt: skip


async def start_server(model, probe, policy, max_batch: int = 8, **governor_kw) -> EngineServer:
    engine = Engine(str(model), [Handler(str(model), policy.ladder[0], max_batch=max_batch)])
    governor = Governor(
        engine, probe, policy, interval_s=0.05, allow_unevaluated=("all",), **governor_kw
    )
    server = EngineServer(engine, ServerConfig(port=0, api_key=API_KEY), governor)
    await server.start()
    return server


class Stream:
    """A streamed request run as a task: its variant, bytes, chunk times and how it ended."""

    def __init__(self, client: httpx.AsyncClient, payload: dict) -> None:
        self.variant: str | None = None
        self.status: int | None = None
        self.pcm = bytearray()
        self.times: list[float] = []
        self.t0 = time.perf_counter()
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._run(client, payload))

    async def _run(self, client, payload) -> None:
        async with client.stream("POST", "/v1/audio/speech", json=payload, headers=AUTH) as r:
            self.status, self.variant = r.status_code, r.headers.get(HEADER_VARIANT)
            async for data in r.aiter_raw():
                self.pcm += data
                self.times.append(time.perf_counter())
                self.first.set()
        self.first.set()
        self.end = time.perf_counter()

    async def done(self) -> Stream:
        await self.task
        return self


async def wait_for_swap(governor: Governor, n: int, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while len(governor.history) < n or governor.history[n - 1].ok is None:
        assert time.monotonic() < deadline, f"no swap #{n}: {await governor.status()}"
        await asyncio.sleep(0.05)
    rec = governor.history[n - 1]
    assert rec.ok, rec
    return rec


async def test_pressure_steps_down_while_an_utterance_streams_and_back_up(tiny_checkpoint):
    model = tiny_checkpoint("custom_voice")
    probe = ManualProbe(limit_bytes=64 * GB, pressure=0.3)  # room for make-before-break
    policy = Policy(LADDER, downgrade_at=0.8, upgrade_at=0.5, downgrade_hold_s=0.2,
                    upgrade_hold_s=0.5, cooldown_s=0.5, critical_at=0.99)  # fmt: skip
    server = await start_server(model, probe, policy)
    gov = server.governor
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                 timeout=httpx.Timeout(180)) as c:  # fmt: skip
        try:
            # A short reference on bf16 with the same seed: the long utterance must start with it.
            ref = await Stream(c, body(8)).done()
            # The long utterance is consumed in process and paced by the test: the worker makes
            # a chunk only once the previous one was taken (flow control), so it is still
            # speaking on bf16 through both swaps, however fast or slow this machine is.
            frames = 12
            long_result = Result()
            long = server.engine.stream(parse_speech_request(body(frames), Limits()),
                                        result=long_result)  # fmt: skip
            long_pcm = bytearray((await anext(long)).pcm)
            speaking_on = server.engine.active

            probe.set(0.85)  # step 1
            first = await wait_for_swap(gov, 1)
            # The new worker loaded at a lower CPU priority and serves at the normal one.
            assert psutil.Process(server.engine.active.pid).nice() == 0
            after_first = Stream(c, body(4, seed=2))
            probe.set(0.92)  # step 2, while the long utterance still speaks on bf16
            second = await wait_for_swap(gov, 2)
            after_second = await Stream(c, body(4, seed=3)).done()
            await after_first.done()
            # Both swaps are serving, and the bf16 worker still holds the unfinished utterance.
            assert speaking_on in server.engine.retiring and speaking_on.in_flight == 1
            assert speaking_on.state == "draining" and long_result.stats is None
            async for chunk in long:
                long_pcm += chunk.pcm

            assert [(r.from_variant, r.to_variant, r.mode) for r in (first, second)] == [
                ("bf16", "8bit", MAKE_BEFORE_BREAK), ("8bit", "4bit", MAKE_BEFORE_BREAK)]  # fmt: skip
            # It finished on the variant it started on, every chunk in order and whole.
            assert long_result.variant == "bf16" and not long_result.stats["cancelled"]
            assert len(long_pcm) == frames * FRAME_SAMPLES * 2
            assert bytes(long_pcm[: len(ref.pcm)]) == bytes(ref.pcm)
            # Requests that start after each swap are served by the new variant.
            assert (after_first.status, after_first.variant) == (200, "8bit")
            assert (after_second.status, after_second.variant) == (200, "4bit")
            assert len(after_first.pcm) == len(after_second.pcm) == 4 * FRAME_SAMPLES * 2

            # Pressure falls: back up one rung at a time, each after the hold time.
            probe.set(0.3)
            t_low = time.monotonic()
            up1, up2 = await wait_for_swap(gov, 3), await wait_for_swap(gov, 4)
            assert [(r.to_variant, r.direction, r.cause) for r in (up1, up2)] == [
                ("8bit", "up", "recovered"), ("bf16", "up", "recovered")]  # fmt: skip
            assert time.monotonic() - t_low >= 2 * policy.upgrade_hold_s
            back = await Stream(c, body(4, seed=4)).done()
            assert (back.status, back.variant) == (200, "bf16")

            # Old workers are gone; status and metrics tell the story.
            for _ in range(200):
                if not server.engine.retiring:
                    break
                await asyncio.sleep(0.05)
            status = (await c.get("/v1/engine/status")).json()
            g = status["governor"]
            assert status["active_variant"] == "bf16" and len(status["handlers"]) == 1
            assert g["ladder"] == ["bf16", "8bit", "4bit"] and g["position"] == 0
            assert g["pressure"]["source"] == "manual" and g["pressure"]["pressure"] == 0.3
            assert all(g["footprints"][v]["measured"] for v in ("bf16", "8bit", "4bit"))
            assert [h["to_variant"] for h in g["history"]] == ["8bit", "4bit", "8bit", "bf16"]
            assert all(h["latency_s"] > 0 and h["reason"] for h in g["history"])
            metrics = (await c.get("/metrics")).text
            assert (
                'qwen3_tts_variant_swaps_total{direction="down",mode="make-before-break",'
                'reason="pressure",result="ok"} 2.0' in metrics
            )
            assert 'qwen3_tts_active_variant{variant="4bit"} 0.0' in metrics
            assert (
                "qwen3_tts_memory_pressure" in metrics
                and "qwen3_tts_variant_swap_seconds" in metrics
            )
        finally:
            await server.stop()


@pytest.fixture(scope="module")
async def tight(tiny_checkpoint):
    """An engine whose injected limit cannot hold two workers: swaps break before they make."""
    model = tiny_checkpoint("custom_voice")
    probe = ManualProbe(limit_bytes=1 * GB, pressure=0.5)
    policy = Policy(LADDER, downgrade_at=0.8, upgrade_at=0.1, downgrade_hold_s=0.2, cooldown_s=5.0,
                    critical_at=0.99)  # fmt: skip
    server = await start_server(model, probe, policy, max_batch=2)
    yield server, probe
    await server.stop()


async def test_break_before_make_swaps_without_a_failed_request(tight):
    server, probe = tight
    gov = server.governor
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                 timeout=httpx.Timeout(180)) as c:  # fmt: skip
        speaking = Stream(c, body(12))
        alongside = Stream(c, body(12, seed=5))  # the batch (2) is full with these two
        await speaking.first.wait()
        await alongside.first.wait()
        queued = Stream(c, body(4, seed=2))  # waits behind them on bf16
        handler = server.engine.active
        while handler.waiting < 1:
            await asyncio.sleep(0.01)
        probe.set(0.9)  # 0.9 + a ~0.4 GB worker > 0.95 of 1 GB: no room for both
        while gov.swapping is None:
            await asyncio.sleep(0.02)
        ready = await c.get("/ready")
        assert ready.status_code == 503 and ready.json()["swapping"]
        arriving = [Stream(c, body(4, seed=s)) for s in (3, 4)]  # arrive in the gap: they wait
        rec = await wait_for_swap(gov, 1)
        probe.set(0.6)  # the stopped bf16 worker's memory came back
        results = [await s.done() for s in (speaking, alongside, queued, *arriving)]

    assert rec.mode == BREAK_BEFORE_MAKE and (rec.from_variant, rec.to_variant) == ("bf16", "8bit")
    assert rec.cut == 0  # no utterance cut at the hard drain deadline
    assert all(r.status == 200 for r in results)
    for r in (speaking, alongside):  # the utterances in the batch finished on bf16
        assert r.variant == "bf16" and len(r.pcm) == 12 * FRAME_SAMPLES * 2
    for r in (queued, *arriving):
        assert r.variant == "8bit" and len(r.pcm) == 4 * FRAME_SAMPLES * 2
    # the drain waited for the speaking utterances: in order, on one clock, their last audio
    # came before the first audio of the variant that could start only once bf16 had stopped
    assert max(speaking.times[-1], alongside.times[-1]) < min(
        r.times[0] for r in (queued, *arriving)
    )
    assert server.engine.handlers.keys() == {"8bit"} and not server.engine.retiring


async def test_operator_override_http_and_cli(tight, caplog):
    server, probe = tight
    probe.set(0.5)
    url = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(180)) as c:
        assert (await c.post("/v1/engine/variant", json={"variant": "4bit"})).status_code == 401
        bad = await c.post("/v1/engine/variant", json={"variant": "2bit"}, headers=AUTH)
        assert bad.status_code == 400 and "valid variants" in bad.json()["error"]["message"]
        bad = await c.post(
            "/v1/engine/variant", json={"variant": "4bit", "mode": "x"}, headers=AUTH
        )
        assert bad.status_code == 400

        # An utterance as long as the engine allows (4096 frames: minutes of compute for the tiny
        # model, ten times what loading the new variant takes on a loaded CI machine; 400 frames
        # once finished first there), and a hard drain deadline shorter than it: it is cut, and
        # logged.
        server.governor.drain_deadline_s = 0.5
        try:
            speaking = Stream(c, {**body(Limits().max_new_tokens), "seed": 5})
            await speaking.first.wait()
            with caplog.at_level(logging.INFO, logger="qwen3_tts_engine"):
                r = await c.post("/v1/engine/variant", headers=AUTH,
                                 json={"variant": "4bit", "mode": "make-before-break"})  # fmt: skip
                assert r.status_code == 200, r.text
                swap = r.json()["swap"]
                assert (swap["to_variant"], swap["cause"], r.json()["pinned"]) == (
                    "4bit",
                    "manual",
                    "4bit",
                )
                with pytest.raises(httpx.HTTPError):
                    await speaking.done()
        finally:
            server.governor.drain_deadline_s = None
        assert server.governor.history[-1].cut == 1
        assert any("hard deadline" in m for m in caplog.messages)
        assert sum("variant swap 8bit -> 4bit" in m and "serving after" in m
                   for m in caplog.messages) == 1  # one log line per swap  # fmt: skip

        # Pinned: pressure does not move it; the CLI unpins and then reads the status.
        probe.set(0.5)
        assert server.governor.pinned == "4bit"
        env = {"QWEN3_TTS_API_KEY": API_KEY}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            assert await asyncio.to_thread(cli_main, ["variant", "--server", url, "auto"]) == 0
        assert server.governor.pinned is None
        status = (await c.get("/v1/engine/status", headers=AUTH)).json()["governor"]
        assert status["automatic"] and status["active_variant"] == "4bit"


async def test_a_spare_worker_becomes_the_next_variant_and_is_replaced(tiny_checkpoint):
    """`--spare-worker`: the governor keeps a worker process started with no model; a swap under
    way hands it the new variant (the new handler's worker is that process), a new spare is
    started once the old worker retired, and stopping ends every one of them."""
    model = tiny_checkpoint("custom_voice")
    server = await start_server(
        model, ManualProbe(), Policy(ladder=("bf16", "8bit")), spare_worker=True
    )
    governor, pids = server.governor, []
    try:
        first = governor._spare
        assert first is not None and await asyncio.to_thread(first.wait_ready, 120)
        status = (await governor.status())["spare_worker"]
        assert status == {"pid": first.pid} and first.pid != server.engine.active.pid
        pids.append(first.pid)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as c:
            speaking = Stream(c, body(12, seed=4))
            await speaking.first.wait()
            r = await c.post("/v1/engine/variant", headers=AUTH,
                             json={"variant": "8bit", "mode": "make-before-break"})  # fmt: skip
            assert r.status_code == 200, r.text
            await speaking.done()
        assert (
            speaking.status == 200 and len(speaking.pcm) == 12 * FRAME_SAMPLES * 2
        )  # nothing lost
        assert server.engine.active.variant == "8bit" and server.engine.active.pid == first.pid
        await governor.settle()
        second = governor._spare
        assert second is not None and second.pid not in (first.pid, None)
        pids.append(second.pid)
        assert psutil.Process(first.pid).nice() == 0  # it serves at the normal priority
    finally:
        await server.stop()
    assert not [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]


async def test_a_failed_swap_keeps_serving_and_replaces_the_spare_it_used(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """The weights on disk go bad while the engine serves: a swap's new worker (the spare) fails
    to load, the old variant serves on, and a new spare is started for the next swap."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("custom_voice"), model)
    monkeypatch.setenv(
        "QWEN3_TTS_CACHE", str(tmp_path / "cache")
    )  # no quantized copy to fall back on
    server = await start_server(
        model, ManualProbe(), Policy(ladder=("bf16", "8bit")), spare_worker=True
    )
    governor, pids = server.governor, [server.engine.active.pid]
    try:
        first = governor._spare
        assert first is not None and await asyncio.to_thread(first.wait_ready, 120)
        pids.append(first.pid)
        (model / "model.safetensors").write_bytes(b"these are not weights")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as c:
            r = await c.post("/v1/engine/variant", headers=AUTH,
                             json={"variant": "8bit", "mode": "make-before-break"})  # fmt: skip
            assert r.status_code == 503 and r.json()["swap"]["ok"] is False, r.text
            assert r.json()["active_variant"] == "bf16"
            spoken = await c.post("/v1/audio/speech", headers=AUTH, json=body(4, stream=False))
        assert spoken.status_code == 200 and spoken.headers[HEADER_VARIANT] == "bf16"
        assert server.engine.active.pid == pids[0]
        second = governor._spare
        assert second is not None and second.pid not in (first.pid, None)
        pids.append(second.pid)
        assert await asyncio.to_thread(second.wait_ready, 120)
    finally:
        await server.stop()
    assert not [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]


def test_renice_sets_every_thread_of_a_process():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import threading, time; "
                             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
                             "print('two threads', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "two threads"  # its second thread runs (an event)
        assert len(psutil.Process(proc.pid).threads()) == 2
        assert renice(proc.pid, 7)
        assert all(psutil.Process(t.id).nice() == 7 for t in psutil.Process(proc.pid).threads())
        if renice(proc.pid, 0):  # raising the priority again needs CAP_SYS_NICE
            assert psutil.Process(proc.pid).nice() == 0
        if hasattr(os, "SCHED_IDLE") and can_raise_priority():  # a loading worker: idle-scheduled
            assert renice(proc.pid, 10, idle=True)
            assert all(
                os.sched_getscheduler(t.id) == os.SCHED_IDLE
                for t in psutil.Process(proc.pid).threads()
            )
            assert renice(proc.pid, 0)  # serving: the normal policy and priority again
            assert all(os.sched_getscheduler(t.id) == os.SCHED_OTHER and psutil.Process(t.id).nice() == 0
                       for t in psutil.Process(proc.pid).threads())  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
