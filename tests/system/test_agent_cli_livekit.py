"""`voice-agent start | dev | console | connect | download-files`: our parser knows LiveKit's
options (checked here against livekit-agents' own CLI) and the settings flags, so `--help` is
quick and complete, a mistyped flag fails before anything starts, and settings given as flags
reach the worker and its job processes (as environment variables)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from livekit.agents import AgentServer
from livekit.agents.cli._legacy import _build_cli

from voice_agent.cli import LIVEKIT_OPTIONS, build_parser, livekit_argv

VOICE_AGENT = Path(sys.executable).with_name("voice-agent")


def test_livekit_options_match_livekit_agents_cli():
    commands = typer.main.get_command(_build_cli(AgentServer())).commands
    assert set(commands) == set(LIVEKIT_OPTIONS)
    for name, command in commands.items():
        theirs = {p.opts[0].removeprefix("--"): not p.is_flag for p in command.params}
        ours = {option: takes_value for option, takes_value, _ in LIVEKIT_OPTIONS[name]}
        assert ours == theirs, name


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run([str(VOICE_AGENT), *args], capture_output=True, text=True, timeout=120)
    return p, time.perf_counter() - t0


@pytest.mark.parametrize("command", list(LIVEKIT_OPTIONS))
def test_help_lists_settings_and_livekit_options(command):
    p, seconds = _run(command, "--help")
    assert p.returncode == 0, p.stderr
    assert "--tts-url" in p.stdout and "--stt-model" in p.stdout  # our settings
    for option, _, _ in LIVEKIT_OPTIONS[command]:
        assert f"--{option}" in p.stdout
    print(f"voice-agent {command} --help: {seconds:.2f}s")  # a benchmark line, not asserted


@pytest.mark.parametrize("args", [["start", "--tts-urll", "x"], ["dev", "--rload"],
                                  ["start", "--drain-timeout"], ["console", "--url", "ws://x"]])  # fmt: skip
def test_a_mistyped_flag_fails_at_once(args):
    p, _ = _run(*args)
    assert p.returncode == 2
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert "LIVEKIT_URL" not in p.stderr  # it never got as far as checking the server


def test_settings_flags_become_the_workers_environment():
    args = build_parser().parse_args(["start", "--tts-url", "http://127.0.0.1:1", "--no-offline",
                                      "--agent-load-threshold", "0.5", "--url", "ws://lk:7880",
                                      "--drain-timeout", "30", "--log-level", "DEBUG"])  # fmt: skip
    argv, env = livekit_argv(args)
    assert argv == [
        "start",
        "--log-level",
        "DEBUG",
        "--url",
        "ws://lk:7880",
        "--drain-timeout",
        "30",
    ]
    assert env == {"TTS_URL": "http://127.0.0.1:1", "VOICE_AGENT_OFFLINE": "0",
                   "AGENT_LOAD_THRESHOLD": "0.5"}  # fmt: skip
    dev, _ = livekit_argv(build_parser().parse_args(["dev", "--no-reload"]))
    assert dev == ["dev", "--no-reload"]
