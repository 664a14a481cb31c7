"""One local TTS engine per host, shared by its workers, and outliving the one that started it.

With TTS_URL unset each `voice-agent start` worker calls `ensure_tts_engine` (under a host lock)
and `LocalService.stop()` on its way out. These tests run that with real processes: two real
workers on a real LiveKit server, and plain processes calling the same two functions (for a user
that dies by SIGKILL without `stop`). The engine is `qwen3-tts serve` on a tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.support.engine_process import free_port
from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.system.test_livekit_call import _start_worker, _stop_worker

pytestmark = pytest.mark.slow
WAIT = 180.0  # every wait is bounded by this (engine start-up on a busy 2-core machine)


def _until(cond, what: str, timeout: float = WAIT, alive=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        if alive is not None and (problem := alive()):
            raise AssertionError(f"while waiting for {what}: {problem}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _engines(port: int) -> list[psutil.Process]:
    """`qwen3-tts serve ... --port PORT` processes (the servers, not their worker children)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1 :][:1] == [str(port)]:
            found.append(p)
    return found


def _speaks(port: int) -> bool:
    """The engine answers a short synthesis request with audio."""
    body = {"input": "Still here.", "voice": "ryan", "max_new_tokens": 2, "response_format": "pcm"}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body, timeout=120)
    return r.status_code == 200 and len(r.content) > 0


def _gone(port: int) -> bool:
    """No engine process on `port` and nothing answers there."""
    if _engines(port):
        return False
    try:
        httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1)
        return False
    except httpx.HTTPError:
        return True


def _kill_engines(port: int) -> None:
    for p in _engines(port):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass


def test_two_workers_share_one_engine_that_outlives_its_starter(livekit_server, tiny_checkpoint,  # noqa: F811
                                                                tmp_path):  # fmt: skip
    server, tts_port = livekit_server, free_port()
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
           "LIVEKIT_API_SECRET": server.api_secret, "TTS_MODEL": str(tiny_checkpoint("custom_voice")),
           "TTS_PORT": str(tts_port), "LLM_BASE_URL": "http://127.0.0.1:9/v1",  # never asked here
           "VOICE_AGENT_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
           "VOICE_AGENT_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop("TTS_URL", None)
    workers: dict[str, subprocess.Popen] = {}
    logs = {tag: tmp_path / f"worker-{tag}.log" for tag in ("a", "b")}

    def alive() -> str | None:
        for tag, proc in workers.items():
            if proc.poll() is not None and tag not in stopped:
                return (
                    f"worker {tag} exited with {proc.returncode}:\n{logs[tag].read_text()[-3000:]}"
                )
        return None

    stopped: set[str] = set()
    try:
        for tag in ("a", "b"):  # one after the other: a starts the engine, b finds it
            (tmp_path / tag).mkdir()
            workers[tag] = _start_worker({**env, "AGENT_HTTP_PORT": str(free_port())}, tmp_path / tag,
                                         logs[tag])  # fmt: skip
            _until(lambda t=tag: "registered worker" in logs[t].read_text(errors="replace"),
                   f"worker {tag} to register", alive=alive)  # fmt: skip
        engines = _engines(tts_port)
        assert len(engines) == 1, f"{len(engines)} engine processes on port {tts_port}"
        engine = engines[0]

        stopped.add("a")
        _stop_worker(workers["a"])  # the worker that started the engine exits
        assert workers["a"].returncode == 0, logs["a"].read_text()[-3000:]
        assert workers["b"].poll() is None
        assert engine.is_running() and _engines(tts_port) == [engine], (
            "the engine went with worker a"
        )
        assert _speaks(tts_port), "worker b's engine does not speak after worker a exited"

        stopped.add("b")
        _stop_worker(workers["b"])  # the last user exits: the engine stops with it
        assert workers["b"].returncode == 0, logs["b"].read_text()[-3000:]
        _until(lambda: _gone(tts_port), "the engine to stop after its last worker", 60)
    finally:
        for proc in workers.values():
            _stop_worker(proc)
        _kill_engines(tts_port)


USER = """
import json, sys
from voice_agent.services import ensure_tts_engine
from voice_agent.settings import Settings
service = ensure_tts_engine(Settings(tts_model=sys.argv[1], tts_port=int(sys.argv[2]), offline=True))
print(json.dumps({"started": service.proc is not None, "url": service.url}), flush=True)
sys.stdin.readline()  # until told to leave
service.stop()
"""


def test_a_user_killed_without_stop_does_not_count(tiny_checkpoint, tmp_path):
    """Three processes call ensure_tts_engine at once: one engine. The starter leaves normally and
    another user dies by SIGKILL: the engine keeps serving the last one, and stops with it."""
    port = free_port()
    env = {**os.environ, "VOICE_AGENT_CACHE": str(tmp_path / "cache")}
    users = [subprocess.Popen([sys.executable, "-c", USER, str(tiny_checkpoint("custom_voice")), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True) for _ in range(3)]  # fmt: skip
    try:
        reports = [json.loads(_until(u.stdout.readline, "ensure_tts_engine")) for u in users]
        assert [r["started"] for r in reports].count(True) == 1, reports
        assert len(_engines(port)) == 1
        starter = next(u for u, r in zip(users, reports, strict=True) if r["started"])
        others = [u for u in users if u is not starter]

        starter.stdin.write("\n")
        starter.stdin.flush()
        assert starter.wait(60) == 0
        os.killpg(others[0].pid, signal.SIGKILL)  # dies without stop()
        others[0].wait(10)
        assert len(_engines(port)) == 1 and _speaks(port), "the engine stopped with its starter"

        others[1].stdin.write("\n")
        others[1].stdin.flush()
        assert others[1].wait(60) == 0
        _until(lambda: _gone(port), "the engine to stop with its last live user", 60)
    finally:
        for u in users:
            if u.poll() is None:
                os.killpg(u.pid, signal.SIGKILL)
                u.wait(10)
        _kill_engines(port)
