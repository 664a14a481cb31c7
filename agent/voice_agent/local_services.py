"""Local services the agent starts when no URL is configured: the TTS engine and mlx_lm.server.

One engine per host: a worker that finds one of ours already answering on the port reuses it, so
every job process and every worker on a host shares it. A service started here outlives the
process that started it while others on the host use it, and stops with its last user
(`LocalService.stop`). Offline, generated tiny models stand in for the real ones, and the output
says loudly that their voice and answers are random.

Lifecycle: a service is never left behind by the command that started it.

- Users are registered per host under `cache_dir()` (see `_join`); the starter registers before
  the service starts, so the service always has a user.
- Normal exit, Ctrl-C, and SIGTERM during start-up (`_sigterm_as_interrupt`: SIGTERM raises
  SystemExit in the main thread while a service starts) run the cleanup: a service still starting
  is SIGKILLed with its process group; a running one is stopped by `LocalService.stop` when its
  last user leaves.
- Users that die without cleanup (SIGKILL, SIGTERM after start-up, a crash) are caught by a
  watchdog. Each service is launched through a small wrapper (`_service_main`) that forks a
  watchdog process and then execs the service in its place, so the service keeps the pid that
  was started and the watchdog lives in the service's own process group (every `killpg` of the
  service takes it too). The watchdog polls the user registry (under the host lock, never while a
  user holds it) and stops the service's process group once no live user is left; it exits when
  the service does. PR_SET_PDEATHSIG is not used: the service must outlive its starter while
  another live process on the host uses it (and it is Linux-only).

Reuse: a server found on the port is reused only when it is verifiably ours (the registry's
`.started` record is alive and holds the listening socket, or the server identifies itself: the
engine's `/v1/models` has a Qwen3-TTS model card, mlx_lm.server's a non-empty model list) and
healthy. Anything else on the port is a one-line error (`PortInUseError`) that names the port and
the process listening on it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from .settings import Settings

logger = logging.getLogger("voice_agent")
RANDOM_TTS = "the TTS is a generated tiny checkpoint with RANDOM weights: its voice is noise"
RANDOM_LLM = "the LLM is a generated tiny model with RANDOM weights: its answers are gibberish"
STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL after this long
WATCH_INTERVAL_S = 0.5  # how often a service's watchdog looks for live users
_SERVICE_SPEC = "VOICE_AGENT_SERVICE_SPEC"  # the wrapper's instructions (removed before exec)


def cache_dir() -> Path:
    root = Path(os.environ.get("VOICE_AGENT_CACHE", "~/.cache/qwen3-voice-agent")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


class PortInUseError(RuntimeError):
    """Something that is not a healthy service of ours holds a local service's port."""


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
# each holding "pid start-time" so that a pid the OS has reused never counts (`.started` has the
# model the service was started with on a second line).
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


def _record_started(key: str, pid: int, model: str | None = None) -> None:
    record = (_identity(pid) or "") + (f"\n{model}" if model else "")
    (cache_dir() / f"{key}.started").write_text(record)


@dataclass
class _Started:
    pid: int
    model: str | None


def _started(key: str) -> _Started | None:
    """The service started on this host for `key`, if it is still running."""
    path = cache_dir() / f"{key}.started"
    try:
        identity, _, model = path.read_text().partition("\n")
        pid = int(identity.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return _Started(pid, model or None) if _identity(pid) == identity else None


def _stop_started(key: str, proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group of the service started on this host (its workers and its
    watchdog included), SIGKILL after STOP_GRACE_S."""
    started = _started(key)
    (cache_dir() / f"{key}.started").unlink(missing_ok=True)
    if started is None:
        return  # never started here, or already gone
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _kill_group(started.pid, sig)
        try:
            psutil.Process(started.pid).wait(STOP_GRACE_S)  # reaps it when it is our child
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
    except (ProcessLookupError, PermissionError):
        pass


# -- the watchdog -----------------------------------------------------------------------------


def _service_main() -> None:
    """The wrapper a service is launched through (`_launch`): fork the watchdog, then become the
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
        started = _started(key)
        if started is not None and started.pid == service:
            (cache_dir() / f"{key}.started").unlink(missing_ok=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL ends this watchdog too
            _kill_group(service, sig)
            deadline = time.monotonic() + STOP_GRACE_S
            while os.getppid() == service and time.monotonic() < deadline:
                time.sleep(0.1)
            if os.getppid() != service:
                break
        return True  # (the lock is released with the file, or with this process)


def _launch(key: str, cmd: list[str], log, env: dict | None) -> subprocess.Popen:
    """Start `cmd` through `_service_main` in its own session (it outlives job processes)."""
    env = dict(os.environ if env is None else env)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the worker's: the engine's metrics are its own
    env[_SERVICE_SPEC] = json.dumps({"key": key, "cache": str(cache_dir()), "cmd": cmd})
    code = "from voice_agent.local_services import _service_main; _service_main()"
    wrapper = [sys.executable, "-c", code]
    return subprocess.Popen(wrapper, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
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


# -- who holds a port, and is it ours -----------------------------------------------------------


def _listening(proc: psutil.Process, port: int) -> bool:
    try:
        conns = proc.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _registered(key: str, port: int) -> _Started | None:
    """The service of ours started for `key`, when it (or a process of its group) listens on
    `port`: the server there is verifiably the one we started."""
    started = _started(key)
    if started is None:
        return None
    try:
        root = psutil.Process(started.pid)
        group = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    return started if any(_listening(p, port) for p in group) else None


def _holder(port: int) -> str | None:
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
class _Probe:
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


def _probe_tts(url: str) -> _Probe:
    ready = _get(f"{url}/ready")
    if ready is None:
        return _Probe(False)
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
    return _Probe(True, identifies, healthy, why, [str(m.get("id")) for m in cards])


def _probe_llm(url: str) -> _Probe:
    r = _get(f"{url}/v1/models")
    if r is None:
        return _Probe(False)
    body = _json(r) if r.status_code == 200 else None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return _Probe(True, why=_body(r, "/v1/models"))
    models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    why = "" if models else "GET /v1/models lists no model"
    return _Probe(True, identifies=bool(models), healthy=True, why=why, models=models)


def _existing(key: str, port: int, probe: Callable[[], _Probe], what: str,
              setting: str) -> tuple[_Probe, _Started | None] | None:  # fmt: skip
    """The healthy service of ours already on `port` (and its `.started` record when we started
    it), or None when nothing answers there. Anything else there is a PortInUseError."""
    found = probe()
    if not found.answers:
        return None
    registered = _registered(key, port)
    hint = f"stop it or choose another port ({setting})"
    if registered is None and not found.identifies:
        holder = _holder(port) or "another process"
        raise PortInUseError(f"port {port} is in use by {holder}, which is not {what} "
                             f"({found.why}): {hint}")  # fmt: skip
    deadline = time.monotonic() + STOP_GRACE_S  # ours: give a busy one a moment
    while not found.healthy and time.monotonic() < deadline:
        time.sleep(0.5)
        found = probe()
    if not found.healthy:
        holder, why = _holder(port) or "another process", found.why or "it stopped answering"
        raise PortInUseError(f"port {port} is in use by {holder}, {what}, which is not healthy "
                             f"({why}): {hint}")  # fmt: skip
    return found, registered


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


# a tqdm bar ("Fetching 9 files:  44%|####4     | 4/9 [00:12<00:15, ...]"): a download or conversion
_PROGRESS_BAR = re.compile(r"\d+%\|")


def newest_progress(text: str) -> str | None:
    """The newest progress-bar line in `text` (tqdm redraws a bar after a carriage return)."""
    bars = [part.strip() for part in re.split(r"[\r\n]", text) if _PROGRESS_BAR.search(part)]
    return bars[-1] if bars else None


class _LogProgress:
    """The progress bars a starting service writes to its log (hub downloads, quantize-on-load),
    relayed to a person watching the terminal on one line that redraws."""

    def __init__(self, log: Path, offset: int) -> None:
        self.log, self.offset, self.last, self.shown = log, offset, None, False

    def poll(self, what: str) -> bool:
        """True when the service drew a new bar since the last look (it is making progress)."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        self.offset += len(data)
        bar = newest_progress(data.decode(errors="replace"))
        if bar is None or bar == self.last:
            return False
        self.last = bar
        if sys.stderr.isatty():
            print(f"\rvoice-agent: {what}: {bar[:150]}\x1b[K", end="", file=sys.stderr, flush=True)
            self.shown = True
        return True

    def end(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)
            self.shown = False


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float, log: Path,
          port: int, log_offset: int = 0) -> None:  # fmt: skip
    """Until `url` answers. `timeout` counts from the service's last progress bar, so a first
    start that downloads gigabytes on a slow link is not cut short while the bytes keep coming."""
    relay = _LogProgress(log, log_offset)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if relay.poll(what):
                deadline = time.monotonic() + timeout
            if _answers(url):
                return
            if proc.poll() is not None:
                # one line: the last line of its log (an exception, usually) and where the rest is
                lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
                last = f": {lines[-1].strip()}" if lines else ""
                holder = _holder(port)
                held = f"; port {port} is in use by {holder}" if holder else ""
                code = proc.returncode
                raise RuntimeError(f"{what} exited with code {code}{last} (log: {log}){held}")
            time.sleep(0.25)
    finally:
        relay.end()
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f}s without progress "
                       f"(log: {log})")  # fmt: skip


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


def progress(message: str) -> None:
    """A progress line for a person watching a terminal (start-up takes seconds to minutes);
    nothing when stderr is not a terminal, so logs and captured output hold only results."""
    if sys.stderr.isatty():
        print(f"voice-agent: {message}", file=sys.stderr, flush=True)


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def _spawn(key: str, cmd: list[str], log_name: str, ready_url: str, what: str, timeout: float,
           port: int, env: dict | None = None, model: str | None = None) -> subprocess.Popen:  # fmt: skip
    """Start a host-shared service (under its host lock) with this process as its first user,
    wait until it answers and record it. On any failure, Ctrl-C or SIGTERM included, its whole
    process group is killed and this process leaves its users."""
    log = cache_dir() / log_name
    logger.info("starting %s: %s", what, " ".join(cmd))
    progress(f"starting {what} on port {port} (log: {log}) ...")
    t0 = time.monotonic()
    proc = None
    _join(key)  # before the start: the watchdog keeps a service only while it has a live user
    try:
        with open(log, "ab") as fh:
            offset = fh.tell()  # earlier starts' lines are not this start's progress
            proc = _launch(key, cmd, fh, env)
        _wait(ready_url, proc, what, timeout, log, port, offset)
        _record_started(key, proc.pid, model)
        progress(f"{what} is ready ({time.monotonic() - t0:.0f} s)")
    except BaseException:
        if proc is not None:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        _leave(key)
        raise
    return proc


def ensure_tts_engine(settings: Settings, *, timeout: float = 900.0) -> LocalService:
    """The TTS URL to use: the configured one, a running local engine of ours, or a new one."""
    if settings.tts_url:
        return LocalService("tts", settings.tts_url)
    port = settings.tts_port
    url, key = f"http://127.0.0.1:{port}", f"tts-{port}"
    with _sigterm_as_interrupt(), _HostLock(key):
        if _existing(key, port, lambda: _probe_tts(url), "a Qwen3-TTS engine of ours",
                     "TTS_PORT or --tts-port"):  # fmt: skip
            logger.info("reusing the TTS engine already running at %s", url)
            progress(f"using the TTS engine already running on port {port}")
            _join(key)
            return LocalService("tts", url, host_key=key)
        model, notes = settings.tts_model, ()
        variant = settings.tts_variant
        if not hub_model_available(model, settings.offline):
            from qwen3_tts_engine import default_tiny_checkpoint

            model, variant, notes = str(default_tiny_checkpoint()), None, (RANDOM_TTS,)
        cmd = [_bin("qwen3-tts"), "serve", "--model", model, "--port", str(port)]
        if variant:
            cmd += ["--variant", variant]
        proc = _spawn(key, cmd, f"tts-engine-{port}.log", f"{url}/ready", "the local TTS engine",
                      timeout, port)  # fmt: skip
        return LocalService("tts", url, proc, notes, host_key=key)


def _hub_cache_exists() -> None:
    """mlx_lm.server lists the hub cache for `/v1/models` and, when it does not exist, answers 200
    with an empty body: make it exist (a download would create it too)."""
    try:
        from huggingface_hub import constants

        Path(constants.HF_HUB_CACHE).mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError):
        pass


# what mlx_lm.server downloads for a hub model (mlx-lm 0.32's `DEFAULT_ALLOW_PATTERNS`)
MLX_LM_FILES = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]  # fmt: skip


def download_llm(model: str) -> None:
    """Fetch a hub LLM into the hub cache here, in the foreground with its progress bars, before
    mlx_lm.server starts: the server answers at once and loads (downloads) the model behind that
    answer, where nobody sees it and the first reply waits. A model already in the cache is used
    without asking the hub."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(model, allow_patterns=MLX_LM_FILES, local_files_only=True)
        return
    except Exception:  # not (completely) in the cache: huggingface_hub raises several types
        pass
    progress(f"downloading the LLM {model} into the hub cache (once) ...")
    try:
        snapshot_download(model, allow_patterns=MLX_LM_FILES)
    except Exception as e:
        raise RuntimeError(f"cannot download {model!r} ({type(e).__name__}: {e}); without a "
                           "network, pass a local model directory (LLM_MODEL)") from e  # fmt: skip


def ensure_llm(settings: Settings, *, timeout: float = 600.0) -> LocalService:
    """The LLM base URL to use: the configured one, or a local mlx_lm.server of ours."""
    if settings.llm_base_url:
        return LocalService("llm", settings.llm_base_url)
    port = settings.llm_port
    url, key = f"http://127.0.0.1:{port}", f"llm-{port}"
    with _sigterm_as_interrupt(), _HostLock(key):
        found = _existing(key, port, lambda: _probe_llm(url), "an mlx_lm.server of ours",
                          "LLM_PORT or --llm-port")  # fmt: skip
        if found:
            probe, started = found
            logger.info("reusing the LLM server already running at %s", url)
            progress(f"using the LLM server already running on port {port}")
            # mlx_lm.server loads the model a request names: the one it was started with
            model = (started.model if started and started.model
                     else settings.llm_model if settings.llm_model in probe.models
                     else probe.models[-1] if probe.models else None)  # fmt: skip
            _join(key)
            return LocalService("llm", f"{url}/v1", model=model, host_key=key)
        model, notes = settings.llm_model, ()
        if not hub_model_available(model, settings.offline):
            from .tiny_llm import write_tiny_llm

            path = cache_dir() / "tiny-llm"
            if not (path / "config.json").is_file():
                write_tiny_llm(path)
            model, notes = str(path), (RANDOM_LLM,)
        elif not Path(model).expanduser().is_dir():
            download_llm(model)
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1"} if settings.offline else None
        _hub_cache_exists()
        proc = _spawn(key, cmd, f"mlx-lm-server-{port}.log", f"{url}/v1/models",
                      "the local LLM (mlx_lm.server)", timeout, port, env, model)  # fmt: skip
        # mlx_lm.server loads the model a request names: name the one it was started with.
        return LocalService("llm", f"{url}/v1", proc, notes, model=model, host_key=key)
