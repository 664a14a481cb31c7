"""The delay line (`voice_agent.lab.delay_line`) and `voice-agent bench link` as a user runs it
(a real subprocess, the tiny checkpoint, an engine in a network namespace). Both need root: where
there is none they fail with the reason (never skip: CI runs as root). Structure is checked (the
connections each socket kind opened, both rows of the JSON), never speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from voice_agent.lab.delay_line import DelayLine

BIN = Path(sys.executable).parent
ROOT = "the delay line needs root (network namespaces, TUN devices): run the tests as root"


def test_the_delay_line_carries_a_tcp_connection_both_ways():
    """A TCP echo server in the namespace answers a client here through the line: the
    handshake and the data cross the forwarder in both directions."""
    assert os.geteuid() == 0, ROOT
    server = ("import socket, sys; s = socket.create_server((sys.argv[1], 9999)); print('up', "
              "flush=True); c, _ = s.accept(); c.sendall(c.recv(64)); c.close()")  # fmt: skip
    with DelayLine(20.0) as line:
        echo = subprocess.Popen(line.argv([sys.executable, "-c", server, line.far]),
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert echo.stdout.readline().strip() == "up"
            t0 = time.monotonic()
            with socket.create_connection((line.far, 9999), timeout=60) as c:
                handshake = time.monotonic() - t0  # SYN there, SYN-ACK back: one round trip
                t1 = time.monotonic()
                c.sendall(b"hello through the line")
                assert c.recv(64) == b"hello through the line"
                echoed = time.monotonic() - t1  # the data there, its echo back: one more
                assert c.getsockname()[0] == line.near  # it went out through the line's device
        finally:
            echo.wait(60)
    assert line.packets["near_to_far"] >= 3 and line.packets["far_to_near"] >= 2, line.packets
    # the line delays: each round trip takes at least the RTT it emulates (a lower bound that
    # holds at any speed: the forwarder holds every packet RTT/2 each way; never an upper bound)
    assert handshake >= 0.020 and echoed >= 0.020, (handshake, echoed)


def test_delay_lines_are_gone_after_use():
    """The namespace and the devices go with the line (a stale namespace of the same index is
    replaced at the next start)."""
    assert os.geteuid() == 0, ROOT
    with DelayLine(0.0, index=249) as line:
        assert line.netns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout  # fmt: skip
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert line.netns not in names
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "qd249n" not in links


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_voice_agent_bench_link(tmp_path):
    """Two utterances per socket kind at 20 ms RTT: the warm row speaks every utterance on the
    one prewarmed socket (the plugin opened 1, the engine counted 1 + the fresh ones), the fresh
    row opens one per utterance; both rows and the comparison are in the JSON."""
    assert os.geteuid() == 0, ROOT
    out = tmp_path / "link.json"
    p = subprocess.run([str(BIN / "voice-agent"), "bench", "link", "--rtt-ms", "20",
                        "--utterances", "2", "--out", str(out)], capture_output=True, text=True,
                       timeout=840)  # fmt: skip
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    report = json.loads(p.stdout)
    assert json.loads(out.read_text()) == report
    rows = {(r["rtt_ms"], r["socket"]): r for r in report["rows"]}
    assert set(rows) == {(20.0, "fresh"), (20.0, "warm")}
    fresh, warm = rows[(20.0, "fresh")], rows[(20.0, "warm")]
    assert fresh["n"] == warm["n"] == 2
    assert warm["sockets_opened"] == 1 and warm["warm_utterances"] == 2
    assert fresh["sockets_opened"] == 2 and fresh["warm_utterances"] == 0
    for row in (fresh, warm):
        for key in ("first_audio_ms_p50", "link_ms_p50", "engine_first_audio_ms_p50"):
            assert isinstance(row[key], float) and row[key] > 0, (key, row)
    [compare] = report["compare"]
    # the fresh ones (the discarded pair's too) and the one warm socket
    assert compare["rtt_ms"] == 20.0 and compare["engine_connections"] == 2 + 1 + 1
    assert compare["packets"]["near_to_far"] > 0 and compare["packets"]["far_to_near"] > 0
    for key in ("warm_over_fresh", "fresh_minus_warm_ms", "fresh_minus_warm_rtts",
                "link_fresh_minus_warm_ms", "link_fresh_minus_warm_rtts"):  # fmt: skip
        assert isinstance(compare[key], float), (key, compare)
