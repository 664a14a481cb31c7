"""The processes of the soak benchmark: a livekit-server on loopback (the harness's binary and
config, `voice_agent.harness.livekit_server`; its webhooks to the call keeper), one shared
Qwen3-TTS engine, two `voice-agent start` workers. Each runs in its own process group with TMPDIR
in the soak's own folder; every process seen (children included) is remembered with its start
time, sampled for RSS and open files, and checked after the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from voice_agent.harness import livekit_server
from voice_agent.harness.livekit_server import free_port, free_udp_port

API_KEY, API_SECRET = (
    "devkey",
    "soak-secret-0123456789abcdef0123456789",
)  # HMAC keys want >= 32 bytes
ENGINE_KEY, OPERATOR_KEY = "soak-engine-key", "soak-operator-key"
LADDER = ("bf16", "8bit")  # the governor swap goes back and forth between these


@dataclass
class Tracked:
    role: str
    pid: int
    created: float
    rss: list[tuple[float, float]] = field(default_factory=list)  # (run time, bytes)
    fds: list[tuple[float, int]] = field(default_factory=list)


class Stack:
    """Start, kill, restart and sample the soak's processes (all under `workdir`)."""

    def __init__(self, workdir: Path, llm_url: str, clock) -> None:
        self.workdir, self.llm_url, self.clock = workdir, llm_url, clock
        self.logs, self.tmp = workdir / "logs", workdir / "tmp"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        self.binary = livekit_server.find_binary()
        self.lk_port, self.udp_port, self.webhook_port = free_port(), free_udp_port(), free_port()
        self.engine_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}  # role -> process group leader
        self.worker_ports = {tag: free_port() for tag in ("a", "b")}
        self.tracked: dict[tuple[int, float], Tracked] = {}
        self._starts: dict[str, int] = {}
        self.swept: list[dict] = []

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.lk_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.lk_port}"

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def keeper_url(self) -> str:
        return f"http://127.0.0.1:{self.webhook_port}"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self.tmp), "HF_HUB_OFFLINE": "1", **extra}

    def _launch(
        self, role: str, cmd: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen:
        self._starts[role] = self._starts.get(role, 0) + 1
        log = self.logs / f"{role}.log"
        with open(log, "ab") as fh:
            fh.write(f"\n=== start {self._starts[role]} at {self.clock():.1f}s ===\n".encode())
            fh.flush()
            proc = subprocess.Popen(cmd, env=env, cwd=cwd or self.workdir, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        self.procs[role] = proc
        self.track(role, proc.pid)
        return proc

    def log_text(self, role: str) -> str:
        path = self.logs / f"{role}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    # -- livekit-server ---------------------------------------------------------------------------

    def start_livekit(self, timeout: float = 60.0) -> None:
        if self.binary is None:
            raise FileNotFoundError("no livekit-server binary: run scripts/install_livekit_server.sh or set "
                                    "LIVEKIT_SERVER_BIN")  # fmt: skip
        config = self.workdir / "livekit.yaml"
        config.write_text(
            livekit_server.config(
                self.lk_port, self.udp_port, self.webhook_port, API_KEY, API_SECRET
            )
        )
        proc = self._launch(
            "livekit-server", livekit_server.command(self.binary, config), self.env()
        )
        self._wait_http(self.http_url, proc, "livekit-server", timeout)

    def stop_livekit(self) -> None:
        self._stop_group("livekit-server", grace=10.0)

    # -- the engine -------------------------------------------------------------------------------

    def start_engine(self, model: str, timeout: float = 300.0) -> None:
        cmd = [str(Path(sys.executable).with_name("qwen3-tts")), "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.engine_port), "--variant", LADDER[0], "--ladder", ",".join(LADDER),
               "--allow-unevaluated", "all", "--no-governor"]  # fmt: skip
        env = self.env(QWEN3_TTS_API_KEY=ENGINE_KEY, QWEN3_TTS_OPERATOR_KEY=OPERATOR_KEY,
                       QWEN3_TTS_LOG_LEVEL="WARNING")  # fmt: skip
        proc = self._launch("engine", cmd, env)
        self._wait_http(f"{self.engine_url}/ready", proc, "the TTS engine", timeout)

    def engine_status(self) -> dict:
        r = httpx.get(f"{self.engine_url}/v1/engine/status", headers={"Authorization": f"Bearer {ENGINE_KEY}"},
                      timeout=10)  # fmt: skip
        r.raise_for_status()
        return r.json()

    def engine_requests_cut(self) -> int:
        """Speech requests the engine could not finish for a reason of its own (its count, on
        `/metrics`): HTTP 503 before any audio (a dead worker among the causes), or a stream
        aborted after some."""
        text = httpx.get(f"{self.engine_url}/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(("qwen3_tts_requests_total{status=\"503\"}",
                                "qwen3_tts_requests_total{status=\"aborted\"}")):  # fmt: skip
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    # -- the workers ------------------------------------------------------------------------------

    def start_worker(self, tag: str) -> None:
        """`voice-agent start` (returns at once; `registrations(tag)` counts its registrations)."""
        cwd = self.workdir / f"worker-{tag}"  # no .env of the repository is read
        cwd.mkdir(exist_ok=True)
        env = self.env(LIVEKIT_URL=self.url, LIVEKIT_API_KEY=API_KEY, LIVEKIT_API_SECRET=API_SECRET,
                       TTS_URL=self.engine_url, QWEN3_TTS_API_KEY=ENGINE_KEY, LLM_BASE_URL=self.llm_url,
                       LLM_MODEL="soak", TTS_MAX_NEW_TOKENS="6", VOICE_AGENT_OFFLINE="1",
                       LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE="0",
                       VOICE_AGENT_CACHE=str(self.workdir / "va-cache"), WORKER_TAG=tag,
                       AGENT_HTTP_PORT=str(self.worker_ports[tag]), AGENT_LOAD_THRESHOLD="0.95",
                       AGENT_LOAD_CPU="0",  # how busy these shared cores are must not refuse calls
                       KEEPER_URL=self.keeper_url)  # fmt: skip
        exe = str(Path(sys.executable).with_name("voice-agent"))
        self._launch(f"worker-{tag}", [exe, "start", "--log-level", "INFO"], env, cwd)

    def registrations(self, tag: str) -> int:
        return self.log_text(f"worker-{tag}").count("registered worker")

    def worker_alive(self, tag: str) -> bool:
        proc = self.procs.get(f"worker-{tag}")
        return proc is not None and proc.poll() is None

    def kill_group(self, role: str) -> None:
        proc = self.procs[role]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    # -- lifecycle --------------------------------------------------------------------------------

    def _wait_http(self, url: str, proc: subprocess.Popen, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}; see {self.logs}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f}s")

    def _stop_group(self, role: str, grace: float) -> None:
        proc = self.procs.get(role)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self) -> None:
        """Workers first (their jobs end), then the engine and the server; every group swept."""
        for role in sorted(self.procs, key=lambda r: (not r.startswith("worker"), r != "engine")):
            self._stop_group(role, grace=20.0 if role.startswith("worker") else 10.0)
        # SIGKILL only starts an exit: a process that mapped GBs (the engine's fork server) takes
        # a moment to unmap them, and counts as running until it has
        self._wait_gone(timeout=15.0)
        self._sweep()
        self._wait_gone(timeout=15.0)

    def _wait_gone(self, timeout: float) -> None:
        """Until no tracked process (but the soak itself) runs, or `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while any(t.pid != os.getpid() and _same(t) is not None for t in self.tracked.values()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _sweep(self) -> None:
        """SIGKILL any tracked process still running (a child that left its group)."""
        for t in self.tracked.values():
            if t.pid != os.getpid() and _same(t) is not None:
                self.swept.append({"role": t.role, "pid": t.pid})
                try:
                    os.kill(t.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- sampling ---------------------------------------------------------------------------------

    def track(self, role: str, pid: int) -> None:
        try:
            p = psutil.Process(pid)
            key = (pid, p.create_time())
        except psutil.Error:
            return
        self.tracked.setdefault(key, Tracked(role, pid, key[1]))

    def sample(self) -> None:
        """RSS and open files of every process of ours (soak itself, groups and their children)."""
        now = self.clock()
        roots = [("soak", os.getpid())] + [
            (role, p.pid) for role, p in self.procs.items() if p.poll() is None
        ]
        for role, pid in roots:
            try:
                root = psutil.Process(pid)
                family = [(role, root)] + [
                    (f"{role}/{_short(c)}", c) for c in root.children(recursive=True)
                ]
            except psutil.Error:
                continue
            if role == "soak":
                family = family[:1]  # the soak's own children are the process groups
            for name, p in family:
                try:
                    key = (p.pid, p.create_time())
                    rss, fds = p.memory_info().rss, p.num_fds()
                except psutil.Error:
                    continue
                t = self.tracked.setdefault(key, Tracked(name, p.pid, key[1]))
                t.rss.append((now, float(rss)))
                t.fds.append((now, fds))

    def left_running(self) -> list[dict]:
        """Tracked processes (not the soak itself) that still run: what the run left behind."""
        left = []
        for t in self.tracked.values():
            if t.pid != os.getpid() and (p := _same(t)) is not None:
                left.append({"role": t.role, "pid": t.pid, "cmd": " ".join(p.cmdline()[:4])})
        return left


def _same(t: Tracked) -> psutil.Process | None:
    """The process `t` still running (not a zombie, not a new process with a reused pid)."""
    try:
        p = psutil.Process(t.pid)
        if abs(p.create_time() - t.created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


def _short(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    text = " ".join(cmd)
    try:
        parent = " ".join(p.parent().cmdline()) if p.parent() is not None else ""
    except psutil.Error:
        parent = ""
    if "forkserver" in parent:
        return "job"  # forked by LiveKit's forkserver: a job process (it serves calls)
    for marker, name in (("resource_tracker", "resource-tracker"), ("forkserver", "forkserver"),
                         ("spawn_main", "process")):  # fmt: skip
        if marker in text:
            return name  # engine/process: a handler worker; worker-a/process: a job process
    return Path(cmd[0]).name if cmd else "?"
