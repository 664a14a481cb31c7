"""Run `qwen3-tts serve` as a real subprocess on 127.0.0.1 (for kill/restart tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, model: Path | str, port: int | None = None, *args: str,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.model = str(model)
        self.port = port or free_port()
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> EngineProcess:
        exe = Path(sys.executable).with_name("qwen3-tts")
        self.proc = subprocess.Popen(
            [str(exe), "serve", "--model", self.model, "--port", str(self.port), *self.args],
            env={**os.environ, "QWEN3_TTS_LOG_LEVEL": "WARNING", **self.env},
            start_new_session=True,  # kill() takes the worker processes down with it
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"engine on {self.url} not ready after {timeout}s")

    def kill(self) -> None:
        """SIGKILL the server and its workers: connections drop mid-stream."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
