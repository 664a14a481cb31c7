"""How the engine starts its worker processes (dispatch/launch.py): on Linux they fork from one
fork server that imported the worker's modules once, take the server's environment as it is at
their start, and end with the server, fork server included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from qwen3_tts_engine.dispatch.launch import START_ENV, spawn_worker, start_method

PROBE = "tests.support.launch_probe"
ROOT = Path(__file__).resolve().parents[2]  # where `tests.support` imports from
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the fork server is Linux's start method"
)


def _start(name: str) -> tuple[dict, object, object]:
    proc, conn = spawn_worker(None, name, module=PROBE)
    assert conn.poll(120), f"{name} never reported"
    return conn.recv(), proc, conn


@linux_only
def test_workers_fork_from_one_preloaded_server_with_the_current_environment(monkeypatch):
    monkeypatch.delenv(START_ENV, raising=False)
    assert start_method() == "forkserver"
    started = []
    try:
        monkeypatch.setenv("LAUNCH_PROBE_MARK", "first")
        a = _start("probe a")
        started.append(a)
        monkeypatch.setenv("LAUNCH_PROBE_MARK", "second")  # after the fork server started
        b = _start("probe b")
        started.append(b)
    finally:
        for _info, proc, conn in started:
            conn.close()
            proc.join(60)
    (ia, *_), (ib, *_) = a, b
    assert (ia["mark"], ib["mark"]) == ("first", "second")  # not the fork server's environment
    # one fork server, a child of this process, with mlx and the worker imported before the fork
    assert ia["ppid"] == ib["ppid"] != os.getpid()
    assert psutil.Process(ia["ppid"]).ppid() == os.getpid()
    assert ia["worker_preloaded"] and ia["mlx"] and ib["worker_preloaded"]
    assert all(proc.exitcode == 0 for _i, proc, _c in started)


def test_spawn_is_available_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv(START_ENV, "spawn")
    monkeypatch.setenv("LAUNCH_PROBE_MARK", "spawned")
    info, proc, conn = _start("probe spawned")
    conn.close()
    proc.join(60)
    assert info["mark"] == "spawned" and info["ppid"] == os.getpid() and not info["mlx"]
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ValueError, match="forkserver or spawn"):
        start_method()


@linux_only
def test_the_fork_server_and_its_workers_end_when_the_server_is_killed(tmp_path):
    # a stand-in server process: starts a worker, prints the pids, waits to be killed
    script = textwrap.dedent(f"""
        import json, sys, time
        from qwen3_tts_engine.dispatch.launch import spawn_worker
        proc, conn = spawn_worker(None, "probe", module={PROBE!r})
        info = conn.recv()
        print(json.dumps(info), flush=True)
        time.sleep(600)
    """)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop(START_ENV, None)
    server = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        info = json.loads(server.stdout.readline())
        fork_server, worker = psutil.Process(info["ppid"]), psutil.Process(info["pid"])
        assert fork_server.ppid() == server.pid and fork_server.pid != server.pid
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(60)
    gone, alive = psutil.wait_procs([fork_server, worker], timeout=120)
    assert not alive, [p.pid for p in alive]
