"""Who holds a local service's port, and whether it is ours and healthy.

A server found on the port is reused only when it is verifiably ours (the registry's `.started`
record is alive and holds the listening socket, or the server identifies itself: the engine's
`/v1/models` has a Qwen3-TTS model card, mlx_lm.server's a non-empty model list) and healthy.
Anything else on the port is a one-line error (`PortInUseError`) that names the port and the
process listening on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import psutil

from voice_agent.services.registry import STOP_GRACE_S, Started, started


class PortInUseError(RuntimeError):
    """Something that is not a healthy service of ours holds a local service's port."""


def _listening(proc: psutil.Process, port: int) -> bool:
    try:
        conns = proc.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _registered(key: str, port: int) -> Started | None:
    """The service of ours started for `key`, when it (or a process of its group) listens on
    `port`: the server there is verifiably the one we started."""
    found = started(key)
    if found is None:
        return None
    try:
        root = psutil.Process(found.pid)
        group = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    return found if any(_listening(p, port) for p in group) else None


def holder(port: int) -> str | None:
    """Who listens on `port`: "name (pid N: command line)", or None when nobody does."""
    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}  # fmt: skip
    except (psutil.Error, OSError):
        return f"a process this user may not inspect (see `lsof -i :{port}`)"
    if not pids:
        return None
    pid = min((p for p in pids if p is not None), default=None)
    if pid is None:
        return f"a process of another user (see `lsof -i :{port}`)"
    try:
        proc = psutil.Process(pid)
        name = proc.name()
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            cmd = ""
    except psutil.Error:
        return f"pid {pid}"
    cmd = cmd if len(cmd) <= 100 else cmd[:97] + "..."
    return f"{name} (pid {pid}: {cmd})" if cmd else f"{name} (pid {pid})"


@dataclass
class Probe:
    """What answered on a service's port."""

    answers: bool  # something answers HTTP on the port
    identifies: bool = False  # and says it is our kind of service
    healthy: bool = False  # and is ready to serve
    why: str = ""  # what it answered, when it is not ours or not healthy
    models: list[str] = field(default_factory=list)


def _get(url: str, timeout: float = 5.0, headers: dict | None = None) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout, headers=headers)
    except httpx.HTTPError:
        return None


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return None


def _body(r: httpx.Response, path: str) -> str:
    """What `GET path` answered, when it is not what our service answers."""
    if r.status_code != 200:
        return f"GET {path} answered {r.status_code}"
    return f"GET {path} answered 200 with {'an unexpected' if r.content else 'an empty'} body"


def probe_tts(url: str) -> Probe:
    """A Qwen3-TTS engine at `url`? (`/ready`, and a qwen3-tts model card in `/v1/models`)"""
    ready = _get(f"{url}/ready")
    if ready is None:
        return Probe(False)
    key = os.environ.get("QWEN3_TTS_API_KEY")
    models = _get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else None)
    body = _json(models) if models is not None and models.status_code == 200 else None
    data = body.get("data") if isinstance(body, dict) else None
    cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    identifies = any(m.get("owned_by") == "qwen3-tts" for m in cards)
    status = _json(ready)
    healthy = ready.status_code == 200 and isinstance(status, dict) and status.get("ready") is True
    why = ("" if identifies and healthy else _body(ready, "/ready") if not healthy
           else "GET /v1/models has no Qwen3-TTS model card")  # fmt: skip
    return Probe(True, identifies, healthy, why, [str(m.get("id")) for m in cards])


def probe_llm(url: str) -> Probe:
    """An mlx_lm.server at `url`? (a non-empty model list in `/v1/models`)"""
    r = _get(f"{url}/v1/models")
    if r is None:
        return Probe(False)
    body = _json(r) if r.status_code == 200 else None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return Probe(True, why=_body(r, "/v1/models"))
    models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    why = "" if models else "GET /v1/models lists no model"
    return Probe(True, identifies=bool(models), healthy=True, why=why, models=models)


def existing(key: str, port: int, probe: Callable[[], Probe], what: str,
             setting: str) -> tuple[Probe, Started | None] | None:  # fmt: skip
    """The healthy service of ours already on `port` (and its `.started` record when we started
    it), or None when nothing answers there. Anything else there is a PortInUseError."""
    found = probe()
    if not found.answers:
        return None
    registered = _registered(key, port)
    hint = f"stop it or choose another port ({setting})"
    if registered is None and not found.identifies:
        who = holder(port) or "another process"
        raise PortInUseError(f"port {port} is in use by {who}, which is not {what} "
                             f"({found.why}): {hint}")  # fmt: skip
    deadline = time.monotonic() + STOP_GRACE_S  # ours: give a busy one a moment
    while not found.healthy and time.monotonic() < deadline:
        time.sleep(0.5)
        found = probe()
    if not found.healthy:
        who, why = holder(port) or "another process", found.why or "it stopped answering"
        raise PortInUseError(f"port {port} is in use by {who}, {what}, which is not healthy "
                             f"({why}): {hint}")  # fmt: skip
    return found, registered


def answers(url: str) -> bool:
    """`GET url` answers 200 within a second."""
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
