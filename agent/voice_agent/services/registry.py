"""Who uses a host-shared local service, and the processes behind it.

One service per host and port: a service started here outlives the process that started it while
others on the host use it, and stops with its last user (`LocalService.stop`).

- Users are registered per host under `cache_dir()` (`join`); the starter registers before the
  service starts, so the service always has a user.
- Normal exit, Ctrl-C, and SIGTERM during start-up (`sigterm_as_interrupt`: SIGTERM raises
  SystemExit in the main thread while a service starts) run the cleanup: a service still starting
  is SIGKILLed with its process group; a running one is stopped by `LocalService.stop` when its
  last user leaves.
- Users that die without cleanup (SIGKILL, SIGTERM after start-up, a crash) are caught by a
  watchdog. Each service is launched through a small wrapper (`service_main`) that forks a
  watchdog process and then execs the service in its place, so the service keeps the pid that
  was started and the watchdog lives in the service's own process group (every `killpg` of the
  service takes it too). The watchdog polls the user registry (under the host lock, never while a
  user holds it) and stops the service's process group once no live user is left; it exits when
  the service does. PR_SET_PDEATHSIG is not used: the service must outlive its starter while
  another live process on the host uses it (and it is Linux-only).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

logger = logging.getLogger("voice_agent")
STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL after this long
WATCH_INTERVAL_S = 0.5  # how often a service's watchdog looks for live users
_SERVICE_SPEC = "VOICE_AGENT_SERVICE_SPEC"  # the wrapper's instructions (removed before exec)


def cache_dir() -> Path:
    """The agent's cache folder (VOICE_AGENT_CACHE): the user registry, service logs, tiny models."""
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
        with HostLock(self.host_key):
            leave(self.host_key)
            if _live_users(self.host_key):
                logger.info("%s keeps running for its other users on this host", self.name)
                return
            _stop_started(self.host_key, self.proc)


class HostLock:
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


# Who uses a host-shared service, under cache_dir() and the service's host lock:
# `{key}.users/{pid}` per process that uses it and `{key}.started` for the process started here,
# each holding "pid start-time" so that a pid the OS has reused never counts (`.started` has the
# model the service was started with on a second line).
def _identity(pid: int) -> str | None:
    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return None


def _is_running(identity: str) -> bool:
    """The process an `_identity` string names still runs. Its start time is compared within a
    second: psutil adds the kernel's boot time (`btime`, whole seconds, moved when the wall clock
    is stepped) to the start, so the same process can read a second apart; a pid reused within
    that second by another process is not a practical risk."""
    try:
        pid_text, created_text = identity.split()
        pid, created = int(pid_text), float(created_text)
        return abs(psutil.Process(pid).create_time() - created) <= 1.001
    except (ValueError, psutil.Error):
        return False


def join(key: str) -> None:
    """Register this process as a user of the service `key`."""
    users = cache_dir() / f"{key}.users"
    users.mkdir(exist_ok=True)
    (users / str(os.getpid())).write_text(_identity(os.getpid()) or "")


def leave(key: str) -> None:
    """This process no longer uses the service `key`."""
    (cache_dir() / f"{key}.users" / str(os.getpid())).unlink(missing_ok=True)


def _live_users(key: str) -> list[int]:
    """The pids that use the service; files of processes that died without `stop` are removed."""
    users = cache_dir() / f"{key}.users"
    alive = []
    for path in users.iterdir() if users.is_dir() else ():
        if (
            path.name.isdigit()
            and _is_running(text := path.read_text())
            and text.split()[0] == path.name
        ):
            alive.append(int(path.name))
        else:
            path.unlink(missing_ok=True)
    return alive


def record_started(key: str, pid: int, model: str | None = None) -> None:
    """Remember that the service `key` (started with `model`) runs as `pid`."""
    record = (_identity(pid) or "") + (f"\n{model}" if model else "")
    (cache_dir() / f"{key}.started").write_text(record)


@dataclass
class Started:
    """The `.started` record of a running service: its pid and the model it was started with."""

    pid: int
    model: str | None


def started(key: str) -> Started | None:
    """The service started on this host for `key`, if it is still running."""
    path = cache_dir() / f"{key}.started"
    try:
        identity, _, model = path.read_text().partition("\n")
        pid = int(identity.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return Started(pid, model or None) if _is_running(identity) else None


def _stop_started(key: str, proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group of the service started on this host (its workers and its
    watchdog included), SIGKILL after STOP_GRACE_S."""
    found = started(key)
    (cache_dir() / f"{key}.started").unlink(missing_ok=True)
    if found is None:
        return  # never started here, or already gone
    for sig in (signal.SIGTERM, signal.SIGKILL):
        kill_group(found.pid, sig)
        try:
            psutil.Process(found.pid).wait(STOP_GRACE_S)  # reaps it when it is our child
            break
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            break
    if proc is not None:
        proc.poll()


def kill_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group of the service `pid` (gone already: nothing to do)."""
    try:
        os.killpg(pid, sig)  # services run in their own session: the group id is their pid
    except (ProcessLookupError, PermissionError):
        pass


# -- launching, and the watchdog ----------------------------------------------------------------


def launch(key: str, cmd: list[str], log, env: dict | None) -> subprocess.Popen:
    """Start `cmd` through `service_main` in its own session (it outlives job processes)."""
    env = dict(os.environ if env is None else env)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the worker's: the engine's metrics are its own
    env[_SERVICE_SPEC] = json.dumps({"key": key, "cache": str(cache_dir()), "cmd": cmd})
    code = "from voice_agent.services.registry import service_main; service_main()"
    wrapper = [sys.executable, "-c", code]
    return subprocess.Popen(wrapper, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip


def service_main() -> None:
    """The wrapper a service is launched through (`launch`): fork the watchdog, then become the
    service (exec), so that the service keeps this pid and the watchdog shares its group."""
    spec = json.loads(os.environ.pop(_SERVICE_SPEC))
    service = os.getpid()
    if os.fork() == 0:
        try:
            # The service's own stop signals are for the service: the watchdog goes with it.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.environ["VOICE_AGENT_CACHE"] = spec["cache"]
            _watchdog(spec["key"], service)
        finally:
            os._exit(0)
    os.execvp(spec["cmd"][0], spec["cmd"])


def _watchdog(key: str, service: int, interval: float = WATCH_INTERVAL_S) -> None:
    """Until the service (our parent) exits: every `interval` s, when no user holds the host lock,
    stop the service's process group if no live user of it is left (all died without `stop`)."""
    while os.getppid() == service:
        time.sleep(interval)
        try:
            if _stop_if_unused(key, service):
                return
        except OSError as e:  # the registry is being changed under us: look again later
            print(f"voice-agent watchdog: {e}", file=sys.stderr, flush=True)


def _stop_if_unused(key: str, service: int) -> bool:
    """One round of `_watchdog`: True once the service was stopped."""
    with open(cache_dir() / f"{key}.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a user is starting, joining or leaving: look again later
        if _live_users(key):
            return False
        print(f"voice-agent watchdog: no live user of {key} is left: stopping pid {service}",
              file=sys.stderr, flush=True)  # fmt: skip
        found = started(key)
        if found is not None and found.pid == service:
            (cache_dir() / f"{key}.started").unlink(missing_ok=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL ends this watchdog too
            kill_group(service, sig)
            deadline = time.monotonic() + STOP_GRACE_S
            while os.getppid() == service and time.monotonic() < deadline:
                time.sleep(0.1)
            if os.getppid() != service:
                break
        return True  # (the lock is released with the file, or with this process)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While services start: SIGTERM (`timeout`, `kill`) raises SystemExit(143) in the main
    thread, so it runs the same cleanup as Ctrl-C instead of leaving a half-started service.
    Only where SIGTERM has its default action (a handler someone installed is kept)."""

    def interrupt(signum, frame):
        raise SystemExit(128 + signum)

    previous = None
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):  # fmt: skip
        try:
            previous = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main interpreter
            previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
