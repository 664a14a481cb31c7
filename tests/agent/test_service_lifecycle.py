"""The local services a command starts die with it, and only our own healthy servers are reused.

`voice-agent demo` runs as a real subprocess (offline: the generated tiny TTS checkpoint and tiny
LLM) with ports and a cache dir of its own and a unique marker in its environment. Everything it
starts (the TTS engine, mlx_lm.server, their workers and watchdogs) inherits the marker, so
"nothing is left behind" reads: no live process carries it, and the ports are free again.
Signals are sent when the service processes exist (polled), never after a fixed sleep.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from tests.support.engine_process import free_port
from tests.support.marked_processes import processes_with
from voice_agent.settings import Settings

pytestmark = pytest.mark.slow
EXE = str(Path(sys.executable).with_name("voice-agent"))
MARK = "VOICE_AGENT_LIFECYCLE_TEST"  # in the environment of the command and so of all it starts
WAIT = 300.0  # every wait is bounded by this (service start-up on a busy 2-core machine)
SERVICE_WORDS = {"tts": "qwen3-tts", "llm": "mlx_lm.server"}  # in the service's command line


@pytest.fixture(scope="module")
def tiny_tts() -> Path:
    """The tiny checkpoint the offline demo uses, built before any demo runs."""
    from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

    return default_tiny_checkpoint()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One VOICE_AGENT_CACHE for the module (the tiny LLM and the spoken question are made once);
    runs never share a port, so they never share a service."""
    return tmp_path_factory.mktemp("voice-agent-cache")


@pytest.fixture
def make_env(shared_cache, tiny_tts):
    """make_env(**extra): an environment with no agent setting from outside and local services on
    free ports of their own; whatever a run with it leaves behind is killed at teardown."""
    marks: list[str] = []

    def make(**extra: str) -> dict[str, str]:
        names = {f.metadata["env"] for f in fields(Settings)}
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_") and k not in names
        }
        marks.append(uuid.uuid4().hex)
        env.update(HF_HUB_OFFLINE="1", LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE="0",
                   VOICE_AGENT_CACHE=str(shared_cache), TTS_PORT=str(free_port()),
                   LLM_PORT=str(free_port()), **{MARK: marks[-1]})  # fmt: skip
        env.update(extra)
        return env

    yield make
    for mark in marks:
        for proc in _processes_of(mark):
            try:
                proc.kill()
            except psutil.Error:
                pass


def _processes_of(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries `mark` (the command and everything it started)."""
    return processes_with(MARK, mark)


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid}: (gone)")
    return "; ".join(out)


def _until(cond, what: str, timeout: float = WAIT, proc: subprocess.Popen | None = None,
           log: Path | None = None):  # fmt: skip
    """Poll `cond` until it is truthy; fail when `proc` exits first or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise AssertionError(f"the command exited ({proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _none_left(mark: str, timeout: float = 60.0) -> list[psutil.Process]:
    """The processes of `mark` still alive after up to `timeout` s (a service's workers and its
    watchdog end a moment after the service)."""
    deadline = time.monotonic() + timeout
    while (left := _processes_of(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port` (connections in TIME_WAIT do not count, as for a
    server that binds with SO_REUSEADDR, which the engine and mlx_lm.server do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return True
        except OSError:
            return False


def _assert_nothing_left(
    env: dict[str, str], ports: tuple[str, ...] = ("TTS_PORT", "LLM_PORT")
) -> None:
    left = _none_left(env[MARK])
    assert left == [], f"processes of the run outlived it: {_describe(left)}"
    for name in ports:
        assert _port_free(int(env[name])), f"{name} {env[name]} is still taken"


def _default_sigint() -> None:
    # An ignored SIGINT is inherited across exec, and LiveKit's process pool sets SIGINT to
    # SIG_IGN while it starts a process (livekit/agents/ipc/supervised_proc.py, _mask_ctrl_c):
    # a test in this pytest process that ran one can leave it so. A person's Ctrl-C reaches a
    # command whose SIGINT has its default action; so does the test's.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_demo(env: dict[str, str], cwd: Path, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen([EXE, "demo", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=fh, preexec_fn=_default_sigint)  # fmt: skip


def _service_started(env: dict[str, str], which: str) -> psutil.Process | None:
    """The service process `which` ("tts" or "llm") of this run, once it exists."""
    for p in _processes_of(env[MARK]):
        try:
            if SERVICE_WORDS[which] in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


def _run_demo(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "demo", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=2 * WAIT)  # fmt: skip


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "llm"), (signal.SIGTERM, "tts"),
                                       (signal.SIGINT, "llm"), (signal.SIGINT, "tts")],
                         ids=["sigterm-llm", "sigterm-tts", "sigint-llm", "sigint-tts"])  # fmt: skip
def test_a_signal_during_start_up_stops_every_service(tmp_path, make_env, sig, phase):
    """`timeout 30 voice-agent demo` or Ctrl-C while the engine (phase "tts") or, the engine up,
    mlx_lm.server (phase "llm") starts: the command exits and everything it started is gone.
    After the SIGTERM in the LLM phase (the `timeout` case) the same command runs to the end."""
    env = make_env()
    log = tmp_path / "demo.log"
    demo = _start_demo(env, tmp_path, log)
    try:
        _until(lambda: _service_started(env, phase), f"the {phase} service to start", proc=demo,
               log=log)  # fmt: skip
        demo.send_signal(sig)
        demo.wait(WAIT)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(30)
    stderr = log.read_text(errors="replace")
    assert demo.returncode != 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # Ctrl-C or SIGTERM: one line, no traceback
    if sig == signal.SIGTERM:
        assert demo.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), stderr[-3000:]
    else:
        assert demo.returncode == 130 and "voice-agent: interrupted" in stderr, stderr[-3000:]
    _assert_nothing_left(env)

    if (sig, phase) == (signal.SIGTERM, "llm"):  # then `bash scripts/run.sh`, same ports and cache
        p = _run_demo(env, tmp_path, "--json", "--out", str(tmp_path / "reply.wav"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        # quiet: each random-model notice once, no LiveKit deprecation warning per turn
        assert p.stderr.count("RANDOM weights") == 2, p.stderr[-3000:]
        assert "deprecated" not in p.stderr, p.stderr[-3000:]
        assert "Unclosed" not in p.stderr, p.stderr[
            -3000:
        ]  # the plugin's sockets closed with the run
        (turn,) = json.loads(p.stdout)["turns"]
        assert turn["voice_to_voice_s"] is not None
        _assert_nothing_left(env)


def test_services_exit_when_their_only_user_is_sigkilled(tmp_path, make_env):
    """The command dies by SIGKILL (no cleanup runs) once both services are up: the services
    notice that no live user is left and exit."""
    env = make_env()
    cache, log = Path(env["VOICE_AGENT_CACHE"]), tmp_path / "demo.log"
    started = [cache / f"tts-{env['TTS_PORT']}.started", cache / f"llm-{env['LLM_PORT']}.started"]
    demo = _start_demo(env, tmp_path, log)
    try:
        _until(lambda: all(p.is_file() for p in started), "both services to be up", proc=demo,
               log=log)  # fmt: skip
        assert _service_started(env, "tts") and _service_started(env, "llm")
        demo.kill()  # SIGKILL: its `finally` never runs
        assert demo.wait(30) == -signal.SIGKILL
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(30)
    _assert_nothing_left(env)


class _EmptyOK(BaseHTTPRequestHandler):
    """A server that is not ours: 200 with an empty body to every GET."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def foreign_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmptyOK)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("which", ["tts", "llm"])
def test_a_foreign_server_on_the_port_is_a_clear_error(tmp_path, make_env, tiny_tts,
                                                       foreign_server, which):  # fmt: skip
    """Something that is not ours answers on the port (200, empty body): `voice-agent demo`
    neither reuses it nor fails with a traceback, but names the port and the process."""
    setting = f"{which.upper()}_PORT"
    # the checkpoint by path: no warning line about generated weights before the error
    env = make_env(TTS_MODEL=str(tiny_tts), **{setting: str(foreign_server)})
    p = _run_demo(env, tmp_path)
    out = f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.returncode not in (0, None), out
    assert "Traceback" not in p.stderr, out
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("voice-agent: "), out
    me = psutil.Process()
    for word in (f"port {foreign_server}", f"pid {me.pid}", me.name(), setting):
        assert word in lines[0], out
    # for "llm": the engine started before the check is gone too, and its port free
    _assert_nothing_left(env, tuple({"TTS_PORT", "LLM_PORT"} - {setting}))


USER = """
import json, sys
from voice_agent.services import ensure_llm
from voice_agent.settings import Settings
service = ensure_llm(Settings(llm_model=sys.argv[1], llm_port=int(sys.argv[2]), offline=True))
print(json.dumps({"started": service.proc is not None, "model": service.model}), flush=True)
sys.stdin.readline()  # until told to leave
service.stop()
"""


def test_our_own_llm_server_is_reused_with_its_model(tmp_path, make_env, shared_cache):
    """A second user of the port finds the mlx_lm.server the first one started (registered, and
    healthy) and asks for the model it was started with; it stops with its last user."""
    from voice_agent.services.tiny_llm import write_tiny_llm

    model = tmp_path / "tiny-llm"
    write_tiny_llm(model)
    env = make_env()
    port = env["LLM_PORT"]
    users: list[subprocess.Popen] = []
    try:
        for _ in range(2):  # one after the other: the first starts it, the second finds it
            users.append(subprocess.Popen([sys.executable, "-c", USER, str(model), port], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
            report = json.loads(_until(users[-1].stdout.readline, "ensure_llm", proc=users[-1]))
            assert report == {"started": len(users) == 1, "model": str(model)}
        if sys.platform.startswith(
            "linux"
        ):  # mlx on the CPU: the server got OpenBLAS (fast_blas.py)
            (server,) = [p for p in psutil.process_iter(["cmdline"])
                         if "mlx_lm.server" in (p.info["cmdline"] or []) and port in p.info["cmdline"]]  # fmt: skip
            assert "libopenblas" in Path(f"/proc/{server.pid}/maps").read_text()
        for user in users:
            user.stdin.write("\n")
            user.stdin.flush()
            assert user.wait(60) == 0
    finally:
        for user in users:
            if user.poll() is None:
                user.kill()
                user.wait(30)
    _assert_nothing_left(env)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_go_to_a_terminal_only(monkeypatch):
    from voice_agent.services.progress import progress

    terminal, captured = _Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress("starting the local TTS engine on port 1 ...")
    monkeypatch.setattr(sys, "stderr", captured)  # a log file or a pipe: results only
    progress("starting the local TTS engine on port 1 ...")
    assert terminal.getvalue() == "voice-agent: starting the local TTS engine on port 1 ...\n"
    assert captured.getvalue() == ""


def test_a_user_counts_as_live_across_a_boot_time_step(tmp_path, monkeypatch):
    """A user's record holds its pid and start time; psutil's start time moves with the kernel's
    boot time (whole seconds, stepped with the wall clock), so a live user may read a second
    apart: still live (the watchdog once stopped a service under a running user). Another start
    time, or a dead pid, is not."""
    from voice_agent.services import registry

    monkeypatch.setenv("VOICE_AGENT_CACHE", str(tmp_path))
    registry.join("llm-1")
    assert registry._live_users("llm-1") == [os.getpid()]
    pid, created = (registry.cache_dir() / "llm-1.users" / str(os.getpid())).read_text().split()
    user = registry.cache_dir() / "llm-1.users" / pid
    user.write_text(f"{pid} {float(created) - 1.0:.3f}")  # as read before a one-second step
    assert registry._live_users("llm-1") == [os.getpid()]
    user.write_text(f"{pid} {float(created) - 30.0:.3f}")  # another process that had this pid
    assert registry._live_users("llm-1") == [] and not user.exists()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = registry._identity(child.pid)
    child.wait()
    assert record and not registry._is_running(record)
