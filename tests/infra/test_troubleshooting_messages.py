"""Every error message docs/troubleshooting.md quotes is what the programs print: each quote of
the page's table (its first column) is provoked here and found in the program's real output
(`...` and the placeholders NAME and N stand for any text; any number matches any number)."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.engine_process import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def quotes() -> list[str]:
    rows = [line for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines()
            if line.startswith("| `")]  # fmt: skip
    return [q for row in rows for q in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def pattern(quote: str) -> re.Pattern:
    parts = re.split(r"(\.\.\.|\bNAME\b|\bN\b|\d+(?:\.\d+)*)", quote)
    out = []
    for part in parts:
        if part in ("...", "NAME", "N"):
            out.append(".*?")
        elif re.fullmatch(r"\d+(?:\.\d+)*", part or "x"):
            out.append(r"\d+(?:\.\d+)*")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LIVEKIT_", "TTS_", "LLM_", "QWEN3_TTS_API", "QWEN3_TTS_OPERATOR"))}  # fmt: skip
    env.update(HF_HUB_OFFLINE="1", LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE="0",
               VOICE_AGENT_CACHE=str(tmp / "cache"), TTS_PORT=str(free_port()),
               LLM_PORT=str(free_port()))  # fmt: skip
    env.update(extra)
    return env


def _run(tmp: Path, exe: str, *args: str, **env: str) -> str:
    p = subprocess.run([str(BIN / exe), *args], cwd=tmp, env=_env(tmp, **env),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode != 0, p.stdout + p.stderr
    return p.stderr


def _wav(path: Path, loud: bool = True) -> Path:
    t = np.arange(16000) / 16000
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(
            ((0.3 * 32767 if loud else 0) * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes()
        )
    return path


def port_held_by_another_server(tmp: Path) -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return _run(tmp, "voice-agent", "demo", str(_wav(tmp / "turn.wav")),
                    TTS_PORT=str(server.server_address[1]))  # fmt: skip
    finally:
        server.shutdown()


def engine_port_in_use(tmp: Path) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        return _run(tmp, "qwen3-tts", "serve", "--port", str(s.getsockname()[1]), "--model",
                    str(tmp / "no-model"))  # fmt: skip


class SharedEngine:
    """One `qwen3-tts serve` on the default tiny checkpoint for the quotes that need an engine,
    its log in a file (its start's warnings, its requests'); started at first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self.url = ""

    def start(self, tmp: Path) -> SharedEngine:
        if self.proc is not None:
            return self
        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", tmp / "engine.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen([str(BIN / "qwen3-tts"), "serve", "--port", str(port)],
                                         stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


ENGINE = SharedEngine()


@pytest.fixture(scope="module", autouse=True)
def _stop_the_shared_engine():
    yield
    ENGINE.stop()


def unknown_voice(tmp: Path) -> str:
    """The demo asks the real engine (the tiny checkpoint) for its voices."""
    url = ENGINE.start(tmp).url
    return _run(tmp, "voice-agent", "demo", str(_wav(tmp / "turn.wav")), "--tts-voice", "nobody",
                TTS_URL=url)  # fmt: skip


def ladder_warning(tmp: Path) -> str:
    """The engine's start on a fresh checkpoint (no quality report: every quantized rung off)."""
    return ENGINE.start(tmp).log.read_text()


def frame_cap_warning(tmp: Path) -> str:
    engine = ENGINE.start(tmp)
    body = {"input": "Hello there, how are you today?", "voice": "ryan", "max_new_tokens": 2,
            "response_format": "pcm"}  # fmt: skip
    assert httpx.post(f"{engine.url}/v1/audio/speech", json=body, timeout=300).status_code == 200
    deadline = time.monotonic() + 60
    while "frame cap" not in engine.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return engine.log.read_text()


def hub_model_offline(tmp: Path) -> str:
    out = _run(
        tmp, "qwen3-tts", "serve", "--port", "0", "--model", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    )
    assert len(out.strip().splitlines()) == 1, out  # one line: no worker traceback before it
    return out


PROVOKE = {
    "port 8880 is in use by NAME": port_held_by_another_server,
    "qwen3-tts: error: 127.0.0.1:8880 is already in use": engine_port_in_use,
    "LIVEKIT_URL is not set": lambda tmp: _run(tmp, "voice-agent", "start"),
    "cannot reach the LiveKit server at ...": lambda tmp: _run(
        tmp, "voice-agent", "start", LIVEKIT_URL=f"ws://127.0.0.1:{free_port()}",
        LIVEKIT_API_KEY="devkey", LIVEKIT_API_SECRET="secret"),
    "unrecognized arguments: --tts-urll": lambda tmp: _run(tmp, "voice-agent", "start", "--tts-urll", "x"),
    "argument --tts-variant: invalid choice": lambda tmp: _run(tmp, "voice-agent", "demo", "--tts-variant", "9bit"),
    "TTS_PROTOCOL (set in the environment): ...": lambda tmp: _run(tmp, "voice-agent", "demo", TTS_PROTOCOL="carrier-pigeon"),
    "turn.wav is not audio": lambda tmp: (tmp / "turn.wav").write_text("text") and _run(tmp, "voice-agent", "demo", "turn.wav"),
    "turn.wav: no such file": lambda tmp: _run(tmp, "voice-agent", "demo", "turn.wav"),
    "turn.wav is silent": lambda tmp: _run(tmp, "voice-agent", "demo", str(_wav(tmp / "turn.wav", loud=False).name)),
    "the TTS engine has no voice 'nobody'": unknown_voice,
    "unknown voice 'nobody'; voices: ...": lambda tmp: _run(tmp, "qwen3-tts", "say", "Hi.", "--voice", "nobody"),
    "cannot download 'mlx-community/...'": hub_model_offline,
    "governor: 8bit is left off the ladder": ladder_warning,
    "tts-N ran to its frame cap": frame_cap_warning,
    "input must be a non-empty string": lambda tmp: _run(tmp, "qwen3-tts", "say", ""),
    "qwen3-tts: error: refusing to listen on 0.0.0.0 with no API key: ...": lambda tmp: _run(
        tmp, "qwen3-tts", "serve", "--host", "0.0.0.0", "--port", str(free_port())),
}  # fmt: skip
# printed where these tests cannot run it: checked against the program's text instead
SOURCE = {
    "the TTS is a generated tiny checkpoint with RANDOM weights": "agent/voice_agent/services/offline.py",
    "ERROR: MLX needs Apple Silicon (arm64)": "scripts/bootstrap.sh",  # a Mac's set-up
    "no audio device for console mode": "agent/voice_agent/preflight.py",  # PortAudio is here
    # the plugin's warning (tests/plugins/qwen3_tts/test_finish_reasons.py provokes it)
    "ran to its frame cap instead of ending by itself":
        "plugins/livekit-plugins-qwen3-tts/livekit/plugins/qwen3_tts/tts.py",
    "no microphone found for console mode: ...": None,
}  # fmt: skip


def _provoker(quote: str):
    return next((f for key, f in PROVOKE.items() if quote.startswith(key)), None)


SLOW = (
    port_held_by_another_server,
    unknown_voice,
    hub_model_offline,
    ladder_warning,
    frame_cap_warning,
)  # an engine, or more


@pytest.mark.parametrize("quote", [
    pytest.param(q, marks=pytest.mark.slow) if _provoker(q) in SLOW else q for q in quotes()
])  # fmt: skip
def test_the_quoted_message_is_what_the_program_prints(quote, tmp_path):
    provoke = _provoker(quote)
    if provoke is None and quote in SOURCE and SOURCE[quote] is not None:
        assert quote in (ROOT / SOURCE[quote]).read_text(), quote
        return
    if quote == "no microphone found for console mode: ...":
        provoke = lambda tmp: _run(tmp, "voice-agent", "console")  # noqa: E731
    assert provoke is not None, f"docs/troubleshooting.md quotes {quote!r}: no test provokes it"
    out = provoke(tmp_path)
    if "console" in quote and "no microphone" not in out:
        pytest.skip(f"this machine has a microphone (or no PortAudio): {out.strip()}")
    assert pattern(quote).search(out), f"{quote!r} is not in what the program printed:\n{out}"
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("exe, args, starts", [
    ("qwen3-tts", ["say", "Hi.", "--voice", "nobody", "--server", "{url}"],
     "qwen3-tts: error: server answered 400: unknown voice 'nobody'; voices: "),
    ("qwen3-tts", ["variant", "no-such-rung", "--server", "{url}"], "qwen3-tts: error: server answered 4"),
    ("voice-agent", ["keeper"], "voice-agent: error: keeper needs LIVEKIT_URL"),
])  # fmt: skip
def test_every_command_fails_with_one_prefix_and_the_errors_message(tmp_path, exe, args, starts):
    """`PROGRAM: error: ` and the error's message (not a raw JSON body), in one line."""
    url = ENGINE.start(tmp_path).url if any("{url}" in a for a in args) else ""
    out = _run(tmp_path, exe, *(a.format(url=url) for a in args))
    assert out.startswith(starts) and len(out.strip().splitlines()) == 1, out
    assert '{"error"' not in out, out
