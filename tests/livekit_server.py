"""A real LiveKit server for the tests: the pinned `livekit-server` binary on 127.0.0.1.

The binary comes from `scripts/install_livekit_server.sh` (`.cache/bin/livekit-server`) or
`LIVEKIT_SERVER_BIN`; without it the tests that need a server are skipped. When `LIVEKIT_URL`
is set, that server is used instead (with `LIVEKIT_API_KEY` / `LIVEKIT_API_SECRET`, default
devkey / secret) and nothing is started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .engine_process import free_port

REPO = Path(__file__).resolve().parent.parent
VERSION = "1.9.12"
INSTALL_HINT = (
    "run scripts/install_livekit_server.sh (needs Go) or set LIVEKIT_SERVER_BIN / LIVEKIT_URL"
)


@dataclass
class LiveKitServer:
    url: str  # ws://...
    api_key: str
    api_secret: str
    proc: subprocess.Popen | None = None  # None: an external server
    log: Path | None = None
    webhook_port: int | None = None  # the server posts its webhooks to 127.0.0.1:<this>/webhook

    @property
    def http_url(self) -> str:
        return self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)

    def log_tail(self, chars: int = 3000) -> str:
        return (
            self.log.read_text(errors="replace")[-chars:] if self.log and self.log.is_file() else ""
        )


def binary_path() -> Path:
    env = os.environ.get("LIVEKIT_SERVER_BIN")
    return Path(env) if env else REPO / ".cache" / "bin" / "livekit-server"


def find_binary() -> Path | None:
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int, udp_port: int, webhook_port: int) -> str:
    # Loopback only: HTTP/WebSocket and the one UDP port for media bind 127.0.0.1, ICE offers
    # only the loopback candidate, and the ICE/TCP listener (which binds all addresses) is off.
    # The node-selector limits are raised so a busy 2-core machine still gets rooms. Webhooks go to
# a port of this test session's own (a call keeper listens there when a test starts one).
    return f"""\
port: {port}
bind_addresses: ["127.0.0.1"]
rtc:
  tcp_port: 0
  udp_port: {udp_port}
  node_ip: 127.0.0.1
  use_external_ip: false
  enable_loopback_candidate: true
  interfaces:
    includes: [lo]
  ips:
    includes: [127.0.0.1/32]
keys:
  devkey: secret
webhook:
  api_key: devkey
  urls: ["http://127.0.0.1:{webhook_port}/webhook"]
node_selector:
  cpu_load_limit: 100
  sysload_limit: 100
logging:
  level: info
"""


def start_server(binary: Path, workdir: Path, timeout: float = 60.0) -> LiveKitServer:
    port, udp_port, webhook_port = free_port(), free_udp_port(), free_port()
    config = workdir / "livekit.yaml"
    config.write_text(_config(port, udp_port, webhook_port))
    log = workdir / "livekit-server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [str(binary), "--dev", "--config", str(config), "--bind", "127.0.0.1", "--node-ip", "127.0.0.1"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = LiveKitServer(f"ws://127.0.0.1:{port}", "devkey", "secret", proc, log, webhook_port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"livekit-server exited with {proc.returncode}:\n{server.log_tail()}"
            )
        try:
            if httpx.get(server.http_url, timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(server)
    raise TimeoutError(
        f"livekit-server did not answer {server.http_url} within {timeout}s:\n{server.log_tail()}"
    )


def stop_server(server: LiveKitServer) -> None:
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="session")
def livekit_server(tmp_path_factory):
    """A LiveKitServer: the external one of LIVEKIT_URL, or a local livekit-server on free ports."""
    if os.environ.get("LIVEKIT_URL"):
        yield LiveKitServer(os.environ["LIVEKIT_URL"], os.environ.get("LIVEKIT_API_KEY", "devkey"),
                            os.environ.get("LIVEKIT_API_SECRET", "secret"))  # fmt: skip
        return
    binary = find_binary()
    if binary is None:
        problem = f"no livekit-server {VERSION} binary at {binary_path()}: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI is set and the LiveKit tests cannot run: {problem}")
        pytest.skip(problem)
    server = start_server(binary, tmp_path_factory.mktemp("livekit-server"))
    try:
        yield server
    finally:
        stop_server(server)
