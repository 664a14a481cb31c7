"""Local services the agent starts when no URL is configured: the TTS engine and mlx_lm.server.

One engine per host: a worker that finds one already answering on the port reuses it, so every
job process and every worker on a host shares it. A service started here outlives the process
that started it while others on the host use it, and stops with its last user (`LocalService.stop`).
Offline, generated tiny models stand in for the real ones, and the output says loudly that their
voice and answers are random.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from .settings import Settings

logger = logging.getLogger("voice_agent")
RANDOM_TTS = "the TTS is a generated tiny checkpoint with RANDOM weights: its voice is noise"
RANDOM_LLM = "the LLM is a generated tiny model with RANDOM weights: its answers are gibberish"


def cache_dir() -> Path:
    root = Path(os.environ.get("VOICE_AGENT_CACHE", "~/.cache/qwen3-voice-agent")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class LocalService:
    name: str
    url: str
    proc: subprocess.Popen | None = None  # None: started by another process, or not local
    notes: tuple[str, ...] = ()
    model: str | None = None  # the model name to request, when it differs from the settings'
    host_key: str | None = None  # a host-shared local service ("tts-8880"); None: a configured URL

    def stop(self) -> None:
        """Stop using the service: a local one stops when no other live process on the host uses
        it, whoever started it (a configured URL is left alone)."""
        if self.host_key is None:
            return
        with _HostLock(self.host_key):
            _leave(self.host_key)
            if _live_users(self.host_key):
                logger.info("%s keeps running for its other users on this host", self.name)
                return
            _stop_started(self.host_key, self.proc)


# Who uses a host-shared service, under cache_dir() and the service's host lock:
# `{key}.users/{pid}` per process that uses it and `{key}.started` for the process started here,
# each holding "pid start-time" so that a pid the OS has reused never counts.
def _identity(pid: int) -> str | None:
    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return None


def _join(key: str) -> None:
    users = cache_dir() / f"{key}.users"
    users.mkdir(exist_ok=True)
    (users / str(os.getpid())).write_text(_identity(os.getpid()) or "")


def _leave(key: str) -> None:
    (cache_dir() / f"{key}.users" / str(os.getpid())).unlink(missing_ok=True)


def _live_users(key: str) -> list[int]:
    """The pids that use the service; files of processes that died without `stop` are removed."""
    users = cache_dir() / f"{key}.users"
    alive = []
    for path in users.iterdir() if users.is_dir() else ():
        if path.name.isdigit() and path.read_text() == _identity(int(path.name)):
            alive.append(int(path.name))
        else:
            path.unlink(missing_ok=True)
    return alive


def _record_started(key: str, pid: int) -> None:
    (cache_dir() / f"{key}.started").write_text(_identity(pid) or "")


def _stop_started(key: str, proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group of the service started on this host (its workers included),
    SIGKILL after 15 s."""
    path = cache_dir() / f"{key}.started"
    recorded = path.read_text() if path.is_file() else ""
    path.unlink(missing_ok=True)
    pid = int(recorded.split()[0]) if recorded else None
    if pid is None or _identity(pid) != recorded:
        return  # never started here, or already gone
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _kill_group(pid, sig)
        try:
            psutil.Process(pid).wait(15)  # reaps it when it is our child
            break
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            break
    if proc is not None:
        proc.poll()


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # services run in their own session: the group id is their pid
    except ProcessLookupError:
        pass


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _answers(url):
            return
        if proc.poll() is not None:
            # one line: the last line of its log (an exception, usually) and where the rest is
            lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
            last = f": {lines[-1].strip()}" if lines else ""
            raise RuntimeError(f"{what} exited with code {proc.returncode}{last} (log: {log})")
        time.sleep(0.25)
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f}s (log: {log})")


class _HostLock:
    """Serializes service start-up between workers on one host."""

    def __init__(self, name: str) -> None:
        self.path = cache_dir() / f"{name}.lock"

    def __enter__(self):
        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether model downloads can work at all (a TCP connection to the hub)."""
    import socket

    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_offline(settings: Settings) -> Settings:
    """Settings with `offline` set when the hub cannot be reached, saying so once."""
    from dataclasses import replace

    if settings.offline or hub_reachable():
        return settings
    logger.warning("no network to the model hub: using bundled and generated models")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return replace(settings, offline=True)


def hub_model_available(model: str, offline: bool) -> bool:
    """True if `model` is a local directory, or a hub id we may download."""
    return Path(model).expanduser().is_dir() or not offline


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def _spawn(cmd: list[str], log_name: str, ready_url: str, what: str, timeout: float,
           env: dict | None = None) -> subprocess.Popen:  # fmt: skip
    """Start a service in its own session (it outlives job processes), wait until it answers."""
    log = cache_dir() / log_name
    logger.info("starting %s: %s", what, " ".join(cmd))
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait(ready_url, proc, what, timeout, log)
    except BaseException:  # not ready, Ctrl-C, SIGTERM: its own session would keep it running
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


def ensure_tts_engine(settings: Settings, *, timeout: float = 900.0) -> LocalService:
    """The TTS URL to use: the configured one, a running local engine, or a new one."""
    if settings.tts_url:
        return LocalService("tts", settings.tts_url)
    url, key = f"http://127.0.0.1:{settings.tts_port}", f"tts-{settings.tts_port}"
    with _HostLock(key):
        if _answers(f"{url}/ready"):
            logger.info("reusing the TTS engine already running at %s", url)
            _join(key)
            return LocalService("tts", url, host_key=key)
        model, notes = settings.tts_model, ()
        variant = settings.tts_variant
        if not hub_model_available(model, settings.offline):
            from qwen3_tts_engine import default_tiny_checkpoint

            model, variant, notes = str(default_tiny_checkpoint()), None, (RANDOM_TTS,)
            logger.warning("offline and %s is not on disk: %s", settings.tts_model, RANDOM_TTS)
        cmd = [_bin("qwen3-tts"), "serve", "--model", model, "--port", str(settings.tts_port)]
        if variant:
            cmd += ["--variant", variant]
        proc = _spawn(cmd, f"tts-engine-{settings.tts_port}.log", f"{url}/ready",
                      "the local TTS engine", timeout)  # fmt: skip
        _record_started(key, proc.pid)
        _join(key)
        return LocalService("tts", url, proc, notes, host_key=key)


def ensure_llm(settings: Settings, *, timeout: float = 600.0) -> LocalService:
    """The LLM base URL to use: the configured one, or a local mlx_lm.server."""
    if settings.llm_base_url:
        return LocalService("llm", settings.llm_base_url)
    url, key = f"http://127.0.0.1:{settings.llm_port}", f"llm-{settings.llm_port}"
    with _HostLock(key):
        if _answers(f"{url}/v1/models"):
            logger.info("reusing the LLM server already running at %s", url)
            models = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
            _join(key)
            return LocalService("llm", f"{url}/v1", model=models[0]["id"] if models else None,
                                host_key=key)  # fmt: skip
        model, notes = settings.llm_model, ()
        if not hub_model_available(model, settings.offline):
            from .tiny_llm import write_tiny_llm

            path = cache_dir() / "tiny-llm"
            if not (path / "config.json").is_file():
                write_tiny_llm(path)
            model, notes = str(path), (RANDOM_LLM,)
            logger.warning("offline and %s is not on disk: %s", settings.llm_model, RANDOM_LLM)
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(settings.llm_port)]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1"} if settings.offline else None
        proc = _spawn(cmd, f"mlx-lm-server-{settings.llm_port}.log", f"{url}/v1/models",
                      "the local LLM (mlx_lm.server)", timeout, env)  # fmt: skip
        _record_started(key, proc.pid)
        _join(key)
        # mlx_lm.server loads the model a request names: name the one it was started with.
        return LocalService("llm", f"{url}/v1", proc, notes, model=model, host_key=key)
