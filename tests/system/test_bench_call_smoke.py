"""Smoke run of `voice-agent bench call` (real livekit-server, one worker, the engine, the paced
LLM stand-in; one turn): the JSON has its keys, the caller heard the reply, and what the report
derives (the share outside the agent's own count) is derived from what it measured. No timing is
checked against a target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from voice_agent.harness.livekit_server import INSTALL_HINT, find_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BIN = Path(sys.executable).parent


def test_voice_agent_bench_call(tmp_path):
    if find_binary() is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI is set and no livekit-server binary: {INSTALL_HINT}")
        pytest.skip(f"no livekit-server binary: {INSTALL_HINT}")
    out = tmp_path / "call.json"
    p = subprocess.run([str(BIN / "voice-agent"), "bench", "call", "--turns", "1", "--runs", "1",
                        "--llm-pace", "200", "--llm-first-token-ms", "20", "--out", str(out)],
                       capture_output=True, text=True, timeout=540,
                       env={**os.environ, "HF_HUB_OFFLINE": "1",
                            "VOICE_AGENT_CACHE": str(tmp_path / "va")})  # fmt: skip
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    report = json.loads(p.stdout)
    assert json.loads(out.read_text()) == report
    assert (
        report["runs"] == 1 and report["turns_per_run"] == 1 and report["nproc"] == os.cpu_count()
    )
    assert report["llm_pace"] == {"tokens_per_s": 200.0, "first_token_s": 0.02}
    assert len(report["loadavg"]) == 2 and all(len(x) == 3 for x in report["loadavg"])
    (run,) = report["per_run"]
    (turn,) = run["turns"]
    # the caller heard the agent's reply after its last sample, and the worker logged the turn
    assert turn["caller_v2v_s"] > 0 and turn["agent_e2e_latency_s"] > 0, turn
    assert turn["outside_agent_s"] == pytest.approx(
        turn["caller_v2v_s"] - turn["agent_e2e_latency_s"]
    )
    assert "paris" in turn["agent_said"], turn
    for key in ("agent_end_of_turn_delay_s", "agent_llm_ttft_s", "agent_tts_ttfb_s"):
        assert turn[key] >= 0, (key, turn)
    s = report["summary"]
    assert s["caller_v2v_s"] == run["caller_v2v_s"] == {"p50": turn["caller_v2v_s"],
                                                         "p95": turn["caller_v2v_s"], "n": 1}  # fmt: skip
    assert report["outside_agent_share_p50"] == pytest.approx(
        turn["outside_agent_s"] / turn["caller_v2v_s"]
    )


def test_turn_lines_are_read_in_either_log_format():
    """`voice-agent start` leaves logging to LiveKit's CLI (JSON records); `dev` and the
    harness print `name: message` lines: the bench reads the turn line in both."""
    import json

    from voice_agent.lab.call_bench import turn_lines

    text = "12:00:00 INFO voice_agent: turn: e2e_latency=0.812s llm_node_ttft=0.100s"
    record = json.dumps({"message": "turn: e2e_latency=0.700s", "level": "INFO",
                         "name": "voice_agent"})  # fmt: skip
    other = json.dumps({"message": "turn: e2e_latency=9.000s", "name": "livekit.agents"})
    assert turn_lines("\n".join([text, "noise", record, other, "{not json"])) == [
        {"e2e_latency": 0.812, "llm_node_ttft": 0.1},
        {"e2e_latency": 0.7},
    ]
