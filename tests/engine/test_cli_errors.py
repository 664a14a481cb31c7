"""`qwen3-tts` mistakes end in one line and a non-zero exit, before any model loads: text that
would speak nothing (the server answers 400 for the same), and a port already in use."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

QWEN3_TTS = Path(sys.executable).with_name("qwen3-tts")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(QWEN3_TTS), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("text", ["", "   ", "\u200b\u200b", "\n\t"])
def test_say_refuses_text_without_speech(text, tmp_path):
    out = tmp_path / "out.wav"
    p = _run("say", text, "--out", str(out))
    assert p.returncode == 2, p.stderr
    assert "input" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()


def test_serve_on_a_port_in_use_is_one_line(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = _run("serve", "--model", str(tiny_checkpoint("custom_voice")), "--port", str(port))
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"127.0.0.1:{port} is already in use" in p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, p.stderr[-2000:]


def test_serve_refuses_an_unknown_compute_dtype():
    p = _run("serve", "--compute-dtype", "bfloat8")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--compute-dtype" in p.stderr and "float32" in p.stderr and "Traceback" not in p.stderr
