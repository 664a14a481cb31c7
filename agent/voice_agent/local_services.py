"""Local services the agent starts when no URL is configured: the TTS engine and mlx_lm.server.

One engine per host: a worker that finds one already answering on the port reuses it, so every
job process and every worker on a host shares it. Offline, generated tiny models stand in for the
real ones, and the output says loudly that their voice and answers are random.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

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
    proc: subprocess.Popen | None = None  # None: somebody else's, reused
    notes: tuple[str, ...] = ()
    model: str | None = None  # the model name to request, when it differs from the settings'

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


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
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.25)
    proc.kill()
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
    _wait(ready_url, proc, what, timeout, log)
    return proc


def ensure_tts_engine(settings: Settings, *, timeout: float = 900.0) -> LocalService:
    """The TTS URL to use: the configured one, a running local engine, or a new one."""
    if settings.tts_url:
        return LocalService("tts", settings.tts_url)
    url = f"http://127.0.0.1:{settings.tts_port}"
    with _HostLock(f"tts-{settings.tts_port}"):
        if _answers(f"{url}/ready"):
            logger.info("reusing the TTS engine already running at %s", url)
            return LocalService("tts", url)
        model, notes = settings.tts_model, ()
        variant = settings.tts_variant
        if not hub_model_available(model, settings.offline):
            from livekit.plugins.qwen3_tts.cli import default_tiny_checkpoint

            model, variant, notes = str(default_tiny_checkpoint()), None, (RANDOM_TTS,)
            logger.warning("offline and %s is not on disk: %s", settings.tts_model, RANDOM_TTS)
        cmd = [_bin("qwen3-tts"), "serve", "--model", model, "--port", str(settings.tts_port)]
        if variant:
            cmd += ["--variant", variant]
        proc = _spawn(cmd, f"tts-engine-{settings.tts_port}.log", f"{url}/ready",
                      "the local TTS engine", timeout)  # fmt: skip
        return LocalService("tts", url, proc, notes)


def ensure_llm(settings: Settings, *, timeout: float = 600.0) -> LocalService:
    """The LLM base URL to use: the configured one, or a local mlx_lm.server."""
    if settings.llm_base_url:
        return LocalService("llm", settings.llm_base_url)
    url = f"http://127.0.0.1:{settings.llm_port}"
    with _HostLock(f"llm-{settings.llm_port}"):
        if _answers(f"{url}/v1/models"):
            logger.info("reusing the LLM server already running at %s", url)
            models = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
            return LocalService("llm", f"{url}/v1", model=models[0]["id"] if models else None)
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
        # mlx_lm.server loads the model a request names: name the one it was started with.
        return LocalService("llm", f"{url}/v1", proc, notes, model=model)
