"""`voice-agent bench soak`: callers keep calling a real livekit-server with two workers and one
shared TTS engine while faults are injected on a schedule; a JSON report of what was lost and how
soon each fault recovered, latency around each fault, RSS/open files over time, and what was left.

Faults (each measured from the caller's side), each injected under load: once a caller is in
the middle of a turn with an agent in its room (events: the callers' own state), and `t` taken in
the same step, so that the turn log shows the turn in flight when it struck (`report.struck_turns`):
- governor_swap: `POST /v1/engine/variant` (operator key) while a turn is in flight;
- engine_worker_kill: SIGKILL of the engine's active handler worker while it synthesizes a reply
  (mid-utterance: its queue not empty when a turn is in flight; the engine's count of requests
  cut by the kill shows it struck one, or it is struck again, up to STRIKES times);
- llm_outage: the proxy in front of the LLM answers 500 for `outage_s` (None: until the first
  spoken apology, the short version);
- livekit_restart: livekit-server stopped and started again on the same ports;
- agent_worker_kill: SIGKILL of the process group of the worker serving a call, mid-turn (the call
  keeper, in this process, gets it a new agent; the killed worker is started again afterwards, and
  the next fault waits for it to register).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from aiohttp import web
from livekit import api

from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.keeper import CallKeeper
from voice_agent.lab.soak.callers import CallerLoop
from voice_agent.lab.soak.fault_proxy import FaultProxy
from voice_agent.lab.soak.report import (
    fault_phases,
    latency_summary,
    lost_turns,
    rss_growth,
    struck_turns,
    turn_totals,
    unexplained_failures,
)
from voice_agent.lab.soak.stack import API_KEY, API_SECRET, LADDER, OPERATOR_KEY, Stack

# agent_worker_kill last: its worker's restart (a minute on a loaded 2-core machine) overlaps
# the short version's last turns instead of delaying the next fault
FAULTS = (
    "governor_swap",
    "engine_worker_kill",
    "llm_outage",
    "livekit_restart",
    "agent_worker_kill",
)
PHRASES = (
    "What time is it right now?",
    "Can you tell me the time please?",
    "Hello, what time is it?",
)
TARGETS = {"agent_worker_kill": "the caller hears an agent again within 10 s",
           "engine_worker_kill": "the next sentence is spoken",
           "governor_swap": "the swap completes and turns go on",
           "llm_outage": "every turn during the outage gets the spoken apology",
           "livekit_restart": "the workers re-register and new calls are answered"}  # fmt: skip
AGENT_BACK_S = 10.0
LOAD_WAIT_S = 120.0  # a hang guard: how long a fault waits for a call in the middle of a turn
STRIKES = (
    3  # engine_worker_kill: kills until one cuts an utterance (a reply may end as it is killed)
)
ANSWER = "Sure, it is noon."  # the LLM stand-in's every answer (not what the soak measures)
MEMORY_GROWTH_PCT = 5.0


@dataclass
class Plan:
    minutes: float
    callers: int
    faults: tuple[str, ...]
    outage_s: float | None = 30.0  # None: until the first spoken apology
    warmup_s: float = 60.0  # no fault before this
    tail_s: float = 120.0  # no fault after minutes*60 - this
    settle_s: float = 15.0  # at least this long between one fault's recovery and the next fault
    grace_s: float = (
        120.0  # the run may go on this long past `minutes` for the last fault's "after"
    )
    window_s: float = 60.0  # before/after windows of the latency phases
    sample_s: float = 5.0
    rss_warmup_s: float = 120.0  # a process's RSS counts from this long after its first sample
    # the short version: every scheduled fault, back to back, and the run ends once the last
    # one has recovered and a turn was heard after it (`minutes` is then an upper bound only)
    every_fault: bool = False

    @classmethod
    def of(cls, minutes: float, callers: int, faults: tuple[str, ...]) -> Plan:
        if minutes <= 5:  # the short version: each fault once, back to back (the first after a
            # heard turn, each next one after the previous one recovered and a turn was heard since)
            return cls(minutes, callers, faults, outage_s=None, warmup_s=5.0, tail_s=20.0, settle_s=3.0,
                       grace_s=150.0, window_s=30.0, sample_s=2.0, rss_warmup_s=30.0, every_fault=True)  # fmt: skip
        return cls(minutes, callers, faults)

    def schedule(self) -> list[tuple[float, str]]:
        """(earliest run time, fault): the fault list once per 10 minutes, spread evenly (the
        short version: all due after the warm-up, one after another)."""
        rounds = max(1, int(self.minutes // 10))
        seq = [f for _ in range(rounds) for f in self.faults]
        if not seq:
            return []
        if self.every_fault:
            return [(self.warmup_s, f) for f in seq]
        span = max(0.0, self.minutes * 60 - self.warmup_s - self.tail_s)
        return [(self.warmup_s + i * span / len(seq), f) for i, f in enumerate(seq)]


def parse_faults(text: str) -> tuple[str, ...]:
    if text in ("", "none"):
        return ()
    if text == "all":
        return FAULTS
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(
            f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}, all or none"
        )
    return names


def progress(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def _tmp_entries() -> set[str]:
    try:
        return set(os.listdir(tempfile.gettempdir()))
    except OSError:
        return set()


class Soak:
    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan, self.workdir = plan, workdir
        self.t0 = time.monotonic()
        # the LLM is not what the soak measures: a stand-in that answers at once, always the same
        self.llm = ScriptedChatServer(ANSWER, use_tool=False, model="soak", keep_requests=False)
        self.proxy: FaultProxy | None = None
        self.stack: Stack | None = None
        self.keeper: CallKeeper | None = None
        self._keeper_runner: web.AppRunner | None = None
        self.callers: list[CallerLoop] = []
        self.faults: list[dict] = []
        self.skipped: list[str] = []
        self.lk: api.LiveKitAPI | None = None
        self.run_end = 0.0
        self._restarts: set[asyncio.Task] = (
            set()
        )  # killed workers started again, until they register

    def clock(self) -> float:
        return time.monotonic() - self.t0

    # -- setup ------------------------------------------------------------------------------------

    async def setup(self) -> None:
        # optional extra: the engine package (`voice-agent[local]`), needed by this command only
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

        await self.llm.start()
        self.proxy = await FaultProxy(f"http://127.0.0.1:{self.llm.port}").start()
        self.stack = stack = Stack(self.workdir, self.proxy.url, self.clock)
        progress(f"livekit-server {stack.binary} on {stack.url}")
        await asyncio.to_thread(stack.start_livekit)
        # dispatch_wait: a busy machine may take seconds to start a job; sooner would add a second agent
        self.keeper = CallKeeper(
            stack.url, API_KEY, API_SECRET, heartbeat_timeout=3.0, dispatch_wait=10.0
        )
        self._keeper_runner = web.AppRunner(self.keeper.app(), access_log=None)
        await self._keeper_runner.setup()
        await web.TCPSite(self._keeper_runner, "127.0.0.1", stack.webhook_port).start()
        model = await asyncio.to_thread(default_tiny_checkpoint)
        progress(f"TTS engine (tiny checkpoint, variants {','.join(LADDER)}) on {stack.engine_url}")
        await asyncio.to_thread(stack.start_engine, str(model))
        for tag in ("a", "b"):
            stack.start_worker(tag)
        for tag in ("a", "b"):
            if not await self._until(
                lambda t=tag: stack.registrations(t) > 0,
                240,
                alive=lambda t=tag: stack.worker_alive(t),
            ):
                raise TimeoutError(
                    f"worker {tag} did not register; see {stack.logs}/worker-{tag}.log"
                )
        progress("two workers registered")
        speech = [load_turn_audio(speech_wav(p, sample_rate=48000)) for p in PHRASES]
        self.lk = api.LiveKitAPI(stack.http_url, API_KEY, API_SECRET)
        self.t0 = time.monotonic()  # the run's clock starts with the calls
        self.callers = [CallerLoop(i, stack.url, API_KEY, API_SECRET, speech, self.clock, log=progress)
                        for i in range(self.plan.callers)]  # fmt: skip

    @staticmethod
    async def _until(cond, timeout: float, step: float = 0.2, alive=None) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            if alive is not None and not alive():
                return False
            await asyncio.sleep(step)
        return False

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        assert self.stack is not None and self.lk is not None
        calls = [
            asyncio.create_task(c.run(self.lk), name=f"caller-{c.index}") for c in self.callers
        ]
        sampler = asyncio.create_task(self._sample_loop(), name="soak-sampler")
        try:
            for at, name in self.plan.schedule():
                await self._sleep_until(at)
                if (
                    not self.faults
                ):  # a turn before the first fault (a busy machine may need longer)
                    await self._until(lambda: self._heard_after(-1.0) is not None, 120)
                if self._restarts:  # a killed worker is back (registered) before the next fault
                    await asyncio.wait(self._restarts)
                if (
                    self.faults
                ):  # the previous fault recovered (or gave up) and a turn was heard since
                    last = self.faults[-1]
                    since = (last["t_recovered"] or self.clock()) + self.plan.settle_s
                    await self._sleep_until(since)
                    await self._until(
                        lambda s=since: self._heard_after(s - self.plan.settle_s) is not None, 60
                    )
                if (
                    not self.plan.every_fault
                    and self.clock() > self.plan.minutes * 60 - self.plan.tail_s / 2
                ):
                    self.skipped.append(name)  # earlier faults took longer than planned
                    continue
                progress(f"t={self.clock():.0f}s: fault {name}")
                record = {
                    "name": name,
                    "t": None,
                    "t_recovered": None,
                    "recovered": False,
                    "recover_s": None,
                }
                self.faults.append(record)
                try:
                    await getattr(self, f"_fault_{name}")(record)
                except Exception as e:  # the fault's own machinery failed: say so, go on
                    record["error"] = f"{type(e).__name__}: {e}"
                if record["t"] is None:
                    record["t"] = self.clock()
                progress(f"t={self.clock():.0f}s: {name} recovered={record['recovered']} "
                         f"in {record['recover_s']}s {record.get('error', '')}")  # fmt: skip
            if not self.plan.every_fault:
                await self._sleep_until(self.plan.minutes * 60)
            if self.faults:  # the last fault gets turns after its recovery too
                last_ok = self.faults[-1]["t_recovered"] or self.clock()
                await self._until(lambda: self._heard_after(last_ok) is not None, 90, 1.0)
        finally:
            self.run_end = self.clock()
            for c in self.callers:
                c.stop.set()
            progress(f"t={self.run_end:.0f}s: hanging up")
            stopping = asyncio.current_task().cancelling()  # SIGTERM / Ctrl-C: hang up at once
            done, pending = await asyncio.wait(calls, timeout=0.1 if stopping else 90)
            for task in pending:
                task.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            sampler.cancel()
            for task in self._restarts:  # a worker still starting: stopped with everything else
                task.cancel()
            await asyncio.gather(sampler, *self._restarts, return_exceptions=True)

    async def _sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.clock()))

    async def _sample_loop(self) -> None:
        assert self.stack is not None
        while True:
            await asyncio.to_thread(self.stack.sample)
            await asyncio.sleep(self.plan.sample_s)

    def turns(self) -> list[dict]:
        return sorted((t for c in self.callers for t in c.turns), key=lambda t: t["t_start"])

    def _heard_after(self, t: float, outcomes=("answer", "apology", "greeting")) -> dict | None:
        """The first turn whose caller finished speaking after `t` and heard the agent."""
        heard = [x for x in self.turns() if x["outcome"] in outcomes and x["t_speech_end"] is not None
                 and x["t_speech_end"] > t]  # fmt: skip
        return (
            min(heard, key=lambda x: x["t_speech_end"] + x["voice_to_voice_s"]) if heard else None
        )

    async def _wait_heard(
        self, t: float, timeout: float, outcomes=("answer", "apology", "greeting")
    ) -> dict | None:
        await self._until(lambda: self._heard_after(t, outcomes) is not None, timeout)
        return self._heard_after(t, outcomes)

    def _busy(self, also: Callable[[CallerLoop], bool] = lambda _c: True) -> CallerLoop | None:
        """A caller in the middle of a turn, with an agent in its room (and `also` true of it)."""
        return next((c for c in self.callers if c.in_turn and c.call is not None
                     and c.call.agent() is not None and also(c)), None)  # fmt: skip

    async def _in_flight(self, timeout: float = LOAD_WAIT_S,
                         also: Callable[[CallerLoop], bool] = lambda _c: True) -> CallerLoop | None:  # fmt: skip
        """A caller in the middle of a turn, with an agent in its room (waits up to `timeout`).
        The caller state is read in the step that returns: a fault injected (and its `t` taken)
        before the next `await` strikes while that turn is in flight."""
        await self._until(lambda: self._busy(also) is not None, timeout, 0.05)
        return self._busy(also)

    @staticmethod
    def _struck(rec: dict, caller: CallerLoop | None) -> None:
        """Note the turn in flight as the fault strikes (None: it struck an idle system)."""
        rec["under_load"] = caller is not None
        if caller is not None:
            rec["struck_turn"] = {"caller": caller.index, "t_start": round(caller.turn_started, 3)}

    # -- faults -----------------------------------------------------------------------------------

    async def _fault_governor_swap(self, rec: dict) -> None:
        assert self.stack is not None
        status = await asyncio.to_thread(self.stack.engine_status)
        target = LADDER[1] if status["active_variant"] == LADDER[0] else LADDER[0]
        self._struck(rec, await self._in_flight())
        rec["t"] = t = self.clock()
        async with httpx.AsyncClient(timeout=300) as c:
            r = await c.post(f"{self.stack.engine_url}/v1/engine/variant", json={"variant": target},
                             headers={"Authorization": f"Bearer {OPERATOR_KEY}"})  # fmt: skip
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        swap = body.get("swap") or {}
        rec.update(to_variant=target, http_status=r.status_code, swap_s=round(self.clock() - t, 2),
                   swap_mode=swap.get("mode"), active_variant=body.get("active_variant"))  # fmt: skip
        turn = await self._wait_heard(t, 120, ("answer",))
        ok = r.status_code == 200 and body.get("active_variant") == target
        if ok and turn is not None:
            rec.update(recovered=True, t_recovered=t + rec["swap_s"], recover_s=rec["swap_s"],
                       next_answer_s=round(turn["t_speech_end"] + turn["voice_to_voice_s"] - t, 2))  # fmt: skip

    async def _fault_engine_worker_kill(self, rec: dict) -> None:
        assert self.stack is not None
        stack = self.stack

        def active() -> dict:
            return next(h for h in stack.engine_status()["handlers"] if h["active"])

        def back_from(victim: dict) -> Callable[[], bool]:
            def back() -> bool:
                try:
                    h = active()
                except Exception:
                    return False
                return h["state"] == "ready" and h["pid"] not in (None, victim["pid"])

            return back

        rec["strikes"] = []
        t_first = None
        for _ in range(STRIKES):
            cut_before = await asyncio.to_thread(stack.engine_requests_cut)
            # mid-utterance: a caller in a turn while the engine's active handler has a request
            deadline = time.monotonic() + LOAD_WAIT_S
            while True:
                victim = await asyncio.to_thread(active)
                caller = self._busy()
                if (
                    caller is not None and victim["queue_depth"] > 0
                ) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)  # in the step that read the state
            self._struck(rec, caller)
            rec["t_strike"] = t = self.clock()  # the strike that counts: the last one
            rec["t"] = t_first = (
                t if t_first is None else t_first
            )  # the fault's window: from the first
            rec.update(pid=victim["pid"], variant=victim["variant"])
            if await self._until(back_from(victim), 180, 0.25):
                rec["handler_back_s"] = round(self.clock() - t, 2)
            # the engine counts the requests the dead worker left unfinished (HTTP 503, or a stream
            # aborted): the kill struck an utterance only if there was one
            cut = await asyncio.to_thread(stack.engine_requests_cut) - cut_before
            rec["strikes"].append(
                {"t": round(t, 2), "queue_depth": victim["queue_depth"], "requests_cut": cut}
            )
            rec["mid_utterance"] = cut > 0
            if cut > 0 or caller is None:
                break
            progress(f"t={self.clock():.0f}s: engine_worker_kill cut no utterance (it ended as the kill came); "
                     "again once a turn is heard")  # fmt: skip
            await self._wait_heard(t, 180)
        turn = await self._wait_heard(rec["t_strike"], 180)
        if turn is not None:
            heard = turn["t_speech_end"] + turn["voice_to_voice_s"]
            rec.update(recovered=True, t_recovered=heard, recover_s=round(heard - rec["t_strike"], 2),
                       next_turn=turn["outcome"])  # fmt: skip

    async def _fault_llm_outage(self, rec: dict) -> None:
        assert self.proxy is not None
        refused = self.proxy.refused
        caller = await self._in_flight()
        self.proxy.outage(self.plan.outage_s if self.plan.outage_s is not None else LOAD_WAIT_S)
        self._struck(rec, caller)
        rec["t"] = t = self.clock()
        if self.plan.outage_s is not None:
            await self._sleep_until(t + self.plan.outage_s)
        else:  # until a turn was refused and answered with the spoken apology (LOAD_WAIT_S at most)
            await self._until(lambda: self.proxy.refused > refused and self._heard_after(t, ("apology",)) is not None,
                              LOAD_WAIT_S, 0.1)  # fmt: skip
            self.proxy.end_outage()
        t_end = self.clock()
        turn = await self._wait_heard(t_end, 120, ("answer",))
        await self._until(
            lambda: all(not c.in_turn or c.turn_started > t_end for c in self.callers), 60
        )
        during = [
            x
            for x in self.turns()
            if x["t_speech_end"] is not None and t <= x["t_speech_end"] <= t_end
        ]
        outcomes = {
            o: sum(x["outcome"] == o for x in during) for o in ("apology", "answer", "failed")
        }
        rec.update(outage_s=round(t_end - t, 2), refused_requests=self.proxy.refused - refused,
                   turns_during=len(during), during=outcomes)  # fmt: skip
        if turn is not None:
            heard = turn["t_speech_end"] + turn["voice_to_voice_s"]
            rec.update(t_recovered=heard, recover_s=round(heard - t_end, 2),
                       recovered=outcomes["failed"] == 0 and outcomes["apology"] >= 1)  # fmt: skip

    async def _fault_agent_worker_kill(self, rec: dict) -> None:
        assert self.stack is not None and self.keeper is not None
        stack = self.stack
        keeper = self.keeper

        def beating(c: CallerLoop) -> bool:
            """Mid-call: the agent's job beats on its heartbeat socket (a kill before its first
            beat is the keeper's timeout case, not this one)."""
            agent = c.call.agent() if c.call is not None else None
            return agent is not None and (c.room_name, agent.identity) in keeper.sockets

        caller = await self._in_flight(also=beating)
        if caller is None:
            raise RuntimeError(
                "no call in the middle of a turn, with an agent beating its heartbeat, to kill"
            )
        caller.hold = True  # the caller stays on the call until its agent is back
        try:
            call, room = caller.call, caller.room_name
            agent = call.agent()
            tag = agent.attributes.get("worker")
            if tag not in ("a", "b"):
                raise RuntimeError(
                    f"the agent in {room} names no worker ({dict(agent.attributes)})"
                )
            regs = stack.registrations(tag)
            rec.update(worker=tag, room=room, lost_agent=agent.identity)
            self._struck(rec, caller)
            rec["t"] = t = self.clock()
            t_mono = time.monotonic()
            await asyncio.to_thread(stack.kill_group, f"worker-{tag}")
            joined: list[float] = []

            def back() -> bool:
                if not joined and (a := call.agent()) is not None and a.identity != agent.identity:
                    joined.append(time.monotonic())
                return (
                    call.loud_after(t_mono, other_than=agent.identity) is not None
                    or caller.call is not call
                )

            ok = await self._until(back, 90, 0.1)
            heard = call.loud_after(t_mono, other_than=agent.identity) if ok else None
            new = call.agent()
            rec["new_agent_worker"] = new.attributes.get("worker") if new is not None else None
            # where the time goes: the keeper's decision (heartbeat timeout), the new agent's join,
            # its first audio (the resume greeting)
            rec["keeper"] = [{"reason": r.reason, "decided_s": round(r.at - t_mono, 2), "dispatch": r.dispatch_id,
                              "error": r.error} for r in self.keeper.recoveries if r.room == room]  # fmt: skip
            rec["new_agent_joined_s"] = round(joined[0] - t_mono, 2) if joined else None
            if heard is not None:
                rec.update(
                    recovered=True,
                    t_recovered=t + (heard - t_mono),
                    recover_s=round(heard - t_mono, 2),
                )
                rec["within_target"] = rec["recover_s"] <= AGENT_BACK_S
        finally:
            caller.hold = False
        stack.start_worker(tag)  # the host comes back: the next fault waits for its registration

        async def registered() -> None:
            if await self._until(
                lambda: stack.registrations(tag) > regs, 240, alive=lambda: stack.worker_alive(tag)
            ):
                rec["worker_restarted_s"] = round(self.clock() - t, 2)

        task = asyncio.create_task(registered(), name=f"restart-worker-{tag}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _fault_livekit_restart(self, rec: dict) -> None:
        assert self.stack is not None
        stack = self.stack
        regs = {tag: stack.registrations(tag) for tag in ("a", "b")}
        self._struck(rec, await self._in_flight())
        rec["t"] = t = self.clock()
        await asyncio.to_thread(stack.stop_livekit)
        rec["down_s"] = round(self.clock() - t, 2)
        rec["t_struck"] = t + rec["down_s"]  # the server is gone (after its drain): calls are cut
        await asyncio.to_thread(stack.start_livekit)
        rec["up_s"] = round(self.clock() - t, 2)
        back = {}
        for tag in ("a", "b"):
            if await self._until(lambda g=tag: stack.registrations(g) > regs[g], 120):
                back[tag] = round(self.clock() - t, 2)
        rec["reregistered_s"] = back
        turn = await self._wait_heard(t + rec["up_s"], 180, ("answer",))
        if turn is not None:
            heard = turn["t_speech_end"] + turn["voice_to_voice_s"]
            rec.update(t_recovered=heard, recover_s=round(heard - t, 2), recovered=len(back) == 2)

    # -- teardown and report ----------------------------------------------------------------------

    async def close(self) -> None:
        if self.lk is not None:
            await self.lk.aclose()
        if self.stack is not None:
            await asyncio.to_thread(self.stack.stop_all)
        if self._keeper_runner is not None:
            await self._keeper_runner.cleanup()
        if self.proxy is not None:
            await self.proxy.stop()
        await self.llm.stop()

    def report(self) -> dict:
        plan, stack = self.plan, self.stack
        turns, end = self.turns(), self.run_end
        faults = []
        for f in self.faults:
            faults.append({**f, "target": TARGETS[f["name"]], "lost_turns": lost_turns(f, turns, end),
                           "struck_turns": struck_turns(f, turns),
                           "phases": fault_phases(f, turns, end, plan.window_s)})  # fmt: skip
        unexplained = unexplained_failures(turns, self.faults, end)
        since, span = min(300.0, 0.3 * end), max(60.0, 0.5 * end)
        processes = []

        def step(samples: list) -> int:  # at most ~30 points per process
            return max(1, len(samples) // 30)

        for t in stack.tracked.values() if stack else []:
            if not t.rss:
                continue
            growth = rss_growth(t.rss, since=since, min_span=span, warmup=plan.rss_warmup_s)
            processes.append({"role": t.role, "pid": t.pid, **growth,
                              "fds_first": t.fds[0][1], "fds_last": t.fds[-1][1],
                              "fds_max": max(n for _, n in t.fds),
                              "rss_mb_over_time": [[round(at), round(v / 2**20, 1)] for at, v in t.rss[::step(t.rss)]]})  # fmt: skip
        # the system under test (server, engine, workers and their children) apart from this
        # driver (callers, call keeper, LLM stand-in and proxy), whose growth is reported too
        long_lived = [
            p
            for p in processes
            if p.get("long_lived") and "growth_pct" in p and p["role"] != "soak"
        ]
        worst = max((p["growth_pct"] for p in long_lived), default=None)
        driver = next((p for p in processes if p["role"] == "soak"), {})
        return {
            "config": {"minutes": plan.minutes, "callers": plan.callers, "faults": list(plan.faults),
                       "outage_s": plan.outage_s, "llm": "a stand-in OpenAI-compatible answerer (streamed chat "
                       "completions, fixed text) behind the fault proxy", "tts": "one shared qwen3-tts engine, "
                       "tiny random checkpoint, variants " + ",".join(LADDER),
                       "workers": 2, "stt": "faster-whisper tiny.en (bundled)"},
            "duration_s": round(end, 1),
            "turns": turn_totals(turns),
            "latency": latency_summary(turns),
            "faults": faults,
            "faults_skipped": self.skipped,
            "unexplained_failures": {"count": len(unexplained), "turns": unexplained[:20]},
            "memory": {"window": {"from_s": round(since, 1), "min_span_s": round(span, 1),
                                  "process_warmup_s": plan.rss_warmup_s},
                       "worst_long_lived_growth_pct": worst, "target_pct": MEMORY_GROWTH_PCT,
                       "driver_growth_pct": driver.get("growth_pct"),
                       "met": worst is not None and worst < MEMORY_GROWTH_PCT, "processes": processes},
            "llm_proxy": {"passed": self.proxy.passed if self.proxy else 0,
                          "refused": self.proxy.refused if self.proxy else 0},
            "keeper_recoveries": [{"t": round(r.at - self.t0, 2), "room": r.room, "reason": r.reason,
                                   "lost_agent": r.lost_agent, "dispatch": r.dispatch_id, "error": r.error}
                                  for r in (self.keeper.recoveries if self.keeper else [])],
            "turn_log": turns,
        }  # fmt: skip


async def _soak(plan: Plan, keep: bool, logs: Path | None = None) -> dict:
    tmp_before = _tmp_entries()
    workdir = Path(tempfile.mkdtemp(prefix="voice-agent-soak-"))
    soak = Soak(plan, workdir)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # SIGTERM stops everything, as Ctrl-C does
    report: dict = {}
    try:
        try:
            await soak.setup()
            progress(f"calling for {plan.minutes:g} min with {plan.callers} caller(s); faults: "
                     f"{', '.join(f'{n}@{at:.0f}s' for at, n in plan.schedule()) or 'none'}")  # fmt: skip
            await soak.run()
        finally:
            progress("stopping everything it started")
            await asyncio.shield(asyncio.ensure_future(soak.close()))
        report = soak.report()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if logs is not None and (workdir / "logs").is_dir():
            shutil.copytree(workdir / "logs", logs, dirs_exist_ok=True)
        report["left_behind"] = _left_behind(soak.stack, workdir, keep, tmp_before)
    return report


def _left_behind(stack: Stack | None, workdir: Path, keep: bool, tmp_before: set[str]) -> dict:
    """After everything was stopped: tracked processes still running, what the processes left in
    their TMPDIR (the work folder's tmp/), and new entries in the system's temp folder."""
    left = stack.left_running() if stack is not None else []
    tmp = workdir / "tmp"
    in_tmpdir = sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []
    if keep:
        progress(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    new_tmp = sorted(_tmp_entries() - tmp_before - ({workdir.name} if keep else set()))
    return {"processes": left, "processes_tracked": len(stack.tracked) if stack else 0,
            "swept": stack.swept if stack else [],  # outlived their process group's stop: killed
            "temp_entries_left_by_processes": in_tmpdir[:50], "workdir": str(workdir),
            "workdir_removed": not workdir.exists(), "tmp_new_entries": new_tmp[:50]}  # fmt: skip


def run_soak(minutes: float, callers: int, faults: tuple[str, ...], out: Path | None, *,
             keep: bool = False, logs: Path | None = None) -> int:  # fmt: skip
    """`voice-agent bench soak` (progress on stderr, the JSON report on stdout and in `out`)."""
    plan = Plan.of(minutes, callers, faults)
    try:
        report = asyncio.run(_soak(plan, keep, logs))
    except asyncio.CancelledError:  # SIGTERM: everything it started was stopped on the way out
        print("voice-agent: soak stopped by SIGTERM", file=sys.stderr)
        return 143
    tmp_new = [e for e in report["left_behind"]["tmp_new_entries"] if out is None or e != out.name]
    report["left_behind"]["tmp_new_entries"] = tmp_new
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text)
    print(text)
    return 0
