"""A real LiveKit server on 127.0.0.1 for the tests and the soak benchmark: the pinned
`livekit-server` binary, its config (loopback only, API keys, webhooks to a port of ours), free
ports, and starting and stopping it.

The binary comes from LIVEKIT_SERVER_BIN, `scripts/install_livekit_server.sh`
(`.cache/bin/livekit-server` in the repository) or PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
VERSION = "1.9.12"
INSTALL_HINT = (
    "run scripts/install_livekit_server.sh (needs Go) or set LIVEKIT_SERVER_BIN / LIVEKIT_URL"
)
DEV_KEY, DEV_SECRET = "devkey", "secret"  # what `livekit-server --dev` accepts


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


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port of 127.0.0.1 nobody listens on (TCP, or `socket.SOCK_DGRAM` for UDP)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


def binary_path() -> Path:
    """Where the binary is expected: LIVEKIT_SERVER_BIN, else the repository's `.cache/bin`."""
    env = os.environ.get("LIVEKIT_SERVER_BIN")
    return Path(env) if env else REPO / ".cache" / "bin" / "livekit-server"


def find_binary() -> Path | None:
    """LIVEKIT_SERVER_BIN, the repository's `.cache/bin/livekit-server`, or one on PATH."""
    for candidate in (os.environ.get("LIVEKIT_SERVER_BIN"), REPO / ".cache" / "bin" / "livekit-server",
                      shutil.which("livekit-server")):  # fmt: skip
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def config(port: int, udp_port: int, webhook_port: int, api_key: str = DEV_KEY,
           api_secret: str = DEV_SECRET) -> str:  # fmt: skip
    """The server's YAML config: loopback only, one key pair, webhooks to 127.0.0.1:`webhook_port`."""
    # Loopback only: HTTP/WebSocket and the one UDP port for media bind 127.0.0.1, ICE offers
    # only the loopback candidate, and the ICE/TCP listener (which binds all addresses) is off.
    # The node-selector limits are raised so a busy 2-core machine still gets rooms. Webhooks go to
    # a port of the caller's own (a call keeper listens there when one is started).
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
  {api_key}: {api_secret}
webhook:
  api_key: {api_key}
  urls: ["http://127.0.0.1:{webhook_port}/webhook"]
node_selector:
  cpu_load_limit: 100
  sysload_limit: 100
logging:
  level: info
"""


def command(binary: Path, config_file: Path, *, dev: bool = False) -> list[str]:
    """The command line of a server on 127.0.0.1 with `config_file` (`dev`: development mode)."""
    return [str(binary), *(["--dev"] if dev else []), "--config", str(config_file),
            "--bind", "127.0.0.1", "--node-ip", "127.0.0.1"]  # fmt: skip


def start_server(binary: Path, workdir: Path, timeout: float = 60.0) -> LiveKitServer:
    """A development-mode server (devkey / secret) on free ports, its config and log in `workdir`;
    returns once it answers HTTP."""
    port, udp_port, webhook_port = free_port(), free_udp_port(), free_port()
    config_file = workdir / "livekit.yaml"
    config_file.write_text(config(port, udp_port, webhook_port))
    log = workdir / "livekit-server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(command(binary, config_file, dev=True), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    server = LiveKitServer(f"ws://127.0.0.1:{port}", DEV_KEY, DEV_SECRET, proc, log, webhook_port)
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
    """SIGTERM the server's process group, SIGKILL after 10 s (an external server is left alone)."""
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
