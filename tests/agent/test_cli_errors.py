"""`voice-agent` errors as a user meets them: the real executable, a one-line message, no
traceback, a non-zero exit, and no engine or LLM left running behind it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
import wave
from dataclasses import fields
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.support.engine_process import free_port
from tests.support.marked_processes import processes_with
from voice_agent.settings import Settings

EXE = str(Path(sys.executable).with_name("voice-agent"))
MARK = "VOICE_AGENT_TEST_RUN"  # in the environment of the command and so of all it starts


@pytest.fixture
def make_env(tmp_path):
    """make_env(**extra): an environment with no LiveKit or agent setting from outside and local
    services on ports of their own; whatever a run with it leaves behind is killed at teardown."""
    marks: list[str] = []

    def make(**extra: str) -> dict[str, str]:
        names = {f.metadata["env"] for f in fields(Settings)}
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("LIVEKIT_") and k not in names
        }
        marks.append(uuid.uuid4().hex)
        env.update(HF_HUB_OFFLINE="1", LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE="0",
                   VOICE_AGENT_CACHE=str(tmp_path / "cache"), TTS_PORT=str(free_port()),
                   LLM_PORT=str(free_port()), **{MARK: marks[-1]})  # fmt: skip
        env.update(extra)
        return env

    yield make
    for mark in marks:
        for proc in _processes_of(mark):
            proc.kill()


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `voice-agent` in `cwd` (a folder with no .env)."""
    return subprocess.run([EXE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _processes_of(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries `mark` (the command and everything it started)."""
    return processes_with(MARK, mark)


def _none_left(mark: str, timeout: float = 30.0) -> list[psutil.Process]:
    """The processes of `mark` still alive after up to `timeout` s (children of a stopped
    service, e.g. multiprocessing's resource tracker, end a moment after their parent)."""
    deadline = time.monotonic() + timeout
    while (left := _processes_of(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _clear_error(p: subprocess.CompletedProcess, *words: str) -> str:
    out = f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.returncode not in (0, None), out
    assert "Traceback" not in p.stderr, out
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("voice-agent: "), out
    assert len(lines) == 1, out
    for word in words:
        assert word in lines[0], out
    return lines[0]


def _nothing_started(env: dict[str, str]) -> None:
    """No local service was started: no process of the run is left, none wrote its log."""
    assert _none_left(env[MARK]) == []
    cache = Path(env["VOICE_AGENT_CACHE"])
    logs = sorted(p.name for p in cache.glob("*.log")) if cache.is_dir() else []
    assert logs == [], f"services were started: {logs}"


def test_start_without_livekit_url(tmp_path, make_env):
    env = make_env()
    p = _run(["start"], env, tmp_path)
    _clear_error(p, "LIVEKIT_URL is not set")
    _nothing_started(env)


@pytest.mark.parametrize("how", ["env", "flag"])
def test_start_with_unreachable_livekit_url(tmp_path, make_env, how):
    url = f"ws://127.0.0.1:{free_port()}"  # a free port: nobody listens there
    env = make_env(LIVEKIT_API_KEY="devkey", LIVEKIT_API_SECRET="secret")
    args = ["start"]
    if how == "env":
        env["LIVEKIT_URL"] = url
    else:  # LiveKit's own --url option, which wins over LIVEKIT_URL
        env["LIVEKIT_URL"] = "ws://127.0.0.1:1"
        args += ["--url", url]
    p = _run(args, env, tmp_path)
    _clear_error(p, "cannot reach the LiveKit server", url)
    _nothing_started(env)


@pytest.mark.parametrize("url", ["ws://127.0.0.1:99999", "127.0.0.1:7880"])
def test_start_with_a_malformed_livekit_url(tmp_path, make_env, url):
    env = make_env(LIVEKIT_URL=url)
    p = _run(["start"], env, tmp_path)
    _clear_error(p, "LIVEKIT_URL", repr(url))
    _nothing_started(env)


@pytest.mark.parametrize("content", [b"this is not audio\n", b""])
def test_demo_with_a_file_that_is_not_a_wav(tmp_path, make_env, content):
    bad = tmp_path / "question.txt"
    bad.write_bytes(content)
    env = make_env()
    p = _run(["demo", str(bad)], env, tmp_path)
    _clear_error(p, str(bad), "WAV")
    _nothing_started(env)


def test_demo_with_a_missing_file(tmp_path, make_env):
    env = make_env()
    p = _run(["demo", str(tmp_path / "nowhere.wav")], env, tmp_path)
    _clear_error(p, "nowhere.wav")
    _nothing_started(env)


def _tone_wav(path: Path) -> Path:
    t = np.arange(16000) / 16000
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes())
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", ["demo", "start"])
def test_a_failing_llm_stops_the_engine_started_before_it(
    tmp_path, make_env, tiny_checkpoint, command
):
    """The TTS engine starts, then mlx_lm.server cannot bind its port (something that never
    answers holds it): the command says so and exits, and the engine is gone with it."""
    with socket.socket() as lk, socket.socket() as squatter:
        lk.bind(("127.0.0.1", 0))  # `start` checks that LiveKit's port accepts connections
        lk.listen()
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        env = make_env(TTS_MODEL=str(tiny_checkpoint("custom_voice")),
                   LLM_PORT=str(squatter.getsockname()[1]), LLM_MODEL=str(tmp_path),
                   LIVEKIT_URL=f"ws://127.0.0.1:{lk.getsockname()[1]}",
                   LIVEKIT_API_KEY="devkey", LIVEKIT_API_SECRET="secret")  # fmt: skip
        args = ["demo", str(_tone_wav(tmp_path / "turn.wav"))] if command == "demo" else ["start"]
        p = _run(args, env, tmp_path, timeout=300)
    cache = Path(env["VOICE_AGENT_CACHE"])
    _clear_error(
        p, "mlx_lm.server", "exited with code", str(cache / f"mlx-lm-server-{env['LLM_PORT']}.log")
    )
    assert (cache / f"tts-engine-{env['TTS_PORT']}.log").is_file()  # the engine did start
    assert _none_left(env[MARK]) == [], "a process of the run outlived it"
    with socket.socket() as s:  # and its port is free again
        s.bind(("127.0.0.1", int(env["TTS_PORT"])))


@pytest.mark.parametrize("argv", [["fleet", "--loads", "1,x"], ["link", "--rtt-ms", "20,fast"]])
def test_bench_lists_of_numbers_are_checked_by_the_parser(argv, capsys):
    from voice_agent.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", *argv])
    assert e.value.code == 2
    assert "takes comma-separated numbers, not" in capsys.readouterr().err
