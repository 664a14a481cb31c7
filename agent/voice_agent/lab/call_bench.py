"""`voice-agent bench call`: voice-to-voice where the caller hears it, beside the agent's own.

A real livekit-server on loopback, one `voice-agent start` worker, the engine (`qwen3-tts
serve`, the tiny checkpoint) and the paced LLM stand-in (`--llm-pace`: a fixed short reply,
no CPU), as the soak benchmark starts them (`soak/stack.py`). Per run a caller (the Python
harness, `harness/caller.py`: WebRTC, 10 ms frames in real time) calls a new room and asks
`--turns` questions, one after another's reply. Per turn, on the caller's clock: its last sample
sent (the end of the speech it played into its track) -> the first loud sample of the agent's
reply it received (`caller_v2v_s`); and LiveKit's own numbers for the same turn, from the
worker's per-turn log line (`voice_agent.observability.TurnMetrics`): `e2e_latency` (the VAD's
end of speech -> the agent's first frame out), end of turn, LLM TTFT, TTS TTFB. The difference
(`outside_agent_s`) is what the agent's own count leaves out: the uplink (Opus, the server, the
agent's jitter buffer), Silero's lag in dating the end of speech (70-110 ms in-process, `vad_end_lag_s`
of `voice-agent bench`), the downlink and the caller's jitter buffer.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from livekit import api

from voice_agent.harness.caller import RATE, Caller
from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.lab.soak.stack import API_KEY, API_SECRET, Stack

QUESTIONS = ("What is the capital of France?", "Can you recommend a good book to read?",
             "What time is it right now?")  # fmt: skip
REPLY = "Sure, the capital of France is Paris."
WAIT = 120.0  # every wait's hang guard
# observability.TurnMetrics' log line: as `voice-agent`'s own handler writes it, or inside
# LiveKit's JSON record (`start` leaves logging to LiveKit's CLI: one JSON object a line)
TURN_LINE = re.compile(r"voice_agent: turn: (.*)$")
TURN_PREFIX = "turn: "


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(xs: list[float]) -> dict:
    return {"p50": statistics.median(xs), "p95": _pct(xs, 0.95), "n": len(xs)} if xs else {}


async def _until(cond, what: str, timeout: float = WAIT, alive=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # polled: these are a remote party's states
        if value := cond():
            return value
        if alive is not None and (problem := alive()):
            raise RuntimeError(f"while waiting for {what}: {problem}")
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no {what} within {timeout:g} s")


def turn_lines(log: str) -> list[dict[str, float]]:
    """The worker's per-turn lines (`turn: e2e_latency=0.812s ...`), as {name: seconds}."""
    out = []
    for line in log.splitlines():
        if m := TURN_LINE.search(line):
            fields = m.group(1)
        elif line.startswith("{") and (record := _json_record(line)) is not None:
            message = record.get("message")
            if record.get("name") != "voice_agent" or not isinstance(message, str):
                continue
            if not message.startswith(TURN_PREFIX):
                continue
            fields = message.removeprefix(TURN_PREFIX)
        else:
            continue
        out.append({k: float(v.rstrip("s")) for k, v in
                    (kv.split("=", 1) for kv in fields.split())})  # fmt: skip
    return out


def _json_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


async def _call(stack: Stack, questions: list, alive) -> list[dict]:
    """One call: each question, then the agent's reply; one row per turn."""
    caller = Caller(f"caller-{uuid.uuid4().hex[:6]}")
    room = f"bench-{uuid.uuid4().hex[:8]}"
    token = (api.AccessToken(API_KEY, API_SECRET).with_identity(caller.identity)
             .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip
    rows = []
    try:
        await caller.join(stack.url, token)
        await _until(caller.listening_agent, "agent listening", alive=alive)
        await _until(lambda: caller.mic_subscribed, "the agent's subscription", alive=alive)
        for text, audio in questions:
            before = len(turn_lines(stack.log_text("worker-a")))
            caller.say(audio)
            end = await _until(lambda: caller.speech_end, "the question spoken", alive=alive)
            heard = await _until(
                lambda e=end: caller.loud_after(e), "the agent's reply", alive=alive
            )
            lines = await _until(lambda b=before: turn_lines(stack.log_text("worker-a"))[b:],
                                 "the worker's turn line", alive=alive)  # fmt: skip
            lk = lines[-1]
            e2e = lk.get("e2e_latency")
            rows.append({"question": text, "caller_v2v_s": heard - end, "agent_e2e_latency_s": e2e,
                         "outside_agent_s": None if e2e is None else heard - end - e2e,
                         "agent_end_of_turn_delay_s": lk.get("end_of_turn_delay"),
                         "agent_llm_ttft_s": lk.get("llm_node_ttft"),
                         "agent_tts_ttfb_s": lk.get("tts_node_ttfb")})  # fmt: skip
            # the reply played out: the agent listens again, and a quiet second on the line
            await _until(lambda h=heard: any(t > h and s == "listening" for t, s in caller.states),
                         "the agent listening again", alive=alive)  # fmt: skip
            # its text stream ends as the reply does (it may come just after the state)
            rows[-1]["agent_said"] = await _until(lambda e=end: caller.text_after(e),
                                                  "the reply's text", alive=alive)  # fmt: skip
            await asyncio.sleep(1.0)
    finally:
        await caller.close()
        lk_api = api.LiveKitAPI(stack.http_url, API_KEY, API_SECRET)
        try:
            await asyncio.wait_for(lk_api.room.delete_room(api.DeleteRoomRequest(room=room)), 10)
        except Exception:  # never created (the join failed)
            pass
        finally:
            await lk_api.aclose()
    return rows


async def _bench(turns: int, runs: int, pace: float, first_token_s: float, model: str,
                 workdir: Path) -> dict:  # fmt: skip
    llm = await ScriptedChatServer(REPLY, use_tool=False, keep_requests=False, pace=pace,
                                   first_token_s=first_token_s).start()  # fmt: skip
    stack = Stack(workdir, llm.url, time.monotonic)
    questions = [(QUESTIONS[i % len(QUESTIONS)],
                  load_turn_audio(speech_wav(QUESTIONS[i % len(QUESTIONS)], sample_rate=RATE)))
                 for i in range(turns)]  # fmt: skip

    def alive() -> str | None:
        return None if stack.worker_alive("a") else f"the worker exited; see {stack.logs}"

    loads = [os.getloadavg()]
    try:
        await asyncio.to_thread(stack.start_livekit)
        await asyncio.to_thread(stack.start_engine, model)
        stack.start_worker("a")
        await _until(lambda: stack.registrations("a"), "the worker's registration", alive=alive)
        per_run = []
        for i in range(runs):
            print(f"voice-agent bench call: run {i + 1} of {runs} ...", file=sys.stderr)
            per_run.append(await _call(stack, questions, alive))
            loads.append(os.getloadavg())
    finally:
        await asyncio.to_thread(stack.stop_all)
        await llm.stop()
    rows = [r for run in per_run for r in run]
    cols = ("caller_v2v_s", "agent_e2e_latency_s", "outside_agent_s", "agent_end_of_turn_delay_s",
            "agent_llm_ttft_s", "agent_tts_ttfb_s")  # fmt: skip
    col = lambda rs, c: _summary([r[c] for r in rs if r[c] is not None])  # noqa: E731
    return {
        "turns_per_run": turns, "runs": runs, "reply": REPLY,
        "llm_pace": {"tokens_per_s": pace, "first_token_s": first_token_s},
        "loadavg": loads, "nproc": os.cpu_count(),
        "per_run": [{"turns": run, **{c: col(run, c) for c in cols}} for run in per_run],
        "summary": {c: col(rows, c) for c in cols},
        # the share of the caller's wait the agent's own e2e_latency does not see, p50 over p50
        "outside_agent_share_p50": (
            col(rows, "outside_agent_s")["p50"] / col(rows, "caller_v2v_s")["p50"]
            if col(rows, "outside_agent_s") else None),
    }  # fmt: skip


def run_call_bench(turns: int, runs: int, pace: float, first_token_s: float, model: str | None,
                   out: Path | None) -> int:  # fmt: skip
    if model is None:
        from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint  # the [local] extra

        model = str(default_tiny_checkpoint())
    with tempfile.TemporaryDirectory(prefix="call-bench-") as tmp:
        report = asyncio.run(_bench(turns, runs, pace, first_token_s, model, Path(tmp)))
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text)
    return 0
