"""`voice-agent web` listens on 127.0.0.1 by default (its token endpoint has no login)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.support.engine_process import free_port

EXE = str(Path(sys.executable).with_name("voice-agent"))
SECRET = "fake-api-secret-for-the-web-tests-0123456789"


def _listening(pid: int, port: int) -> list[str]:
    """The addresses process `pid` listens on at TCP `port`."""
    return sorted(c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)  # fmt: skip


def test_web_listens_on_loopback_only_by_default(tmp_path):
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("LIVEKIT_") or k.startswith("WEB_"))
    }
    env.update(
        LIVEKIT_URL="ws://127.0.0.1:7880", LIVEKIT_API_KEY="devkey", LIVEKIT_API_SECRET=SECRET
    )
    log = tmp_path / "web.log"
    with open(log, "wb") as fh:  # cwd: no .env; no LiveKit server runs: none is needed to serve
        proc = subprocess.Popen([EXE, "web", "--web-port", str(port)], cwd=tmp_path, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).text == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no answer on 127.0.0.1:{port}:\n{log.read_text()}"
            time.sleep(0.1)
        # The listening socket itself: not 0.0.0.0, not :: (tests send traffic to loopback only).
        assert _listening(proc.pid, port) == ["127.0.0.1"]
        assert f"serving http://127.0.0.1:{port}/" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
