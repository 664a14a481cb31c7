"""`voice-agent dev` with its output in a file logs each line once: LiveKit's CLI has its own root
handler, and the one `voice-agent` set up for its own start is gone before LiveKit's takes over
(it printed every line a second time)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")]
WAIT = 120.0  # a hang's bound
OURS = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ [\w.]+: ")  # voice-agent's own log format


def test_dev_logs_each_line_once_into_a_file(livekit_server, tmp_path):  # noqa: F811
    server = livekit_server
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
           "LIVEKIT_API_SECRET": server.api_secret, "TTS_URL": "http://127.0.0.1:9",
           "LLM_BASE_URL": "http://127.0.0.1:9/v1", "LLM_MODEL": "x", "HF_HUB_OFFLINE": "1",
           "VOICE_AGENT_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
           "AGENT_HTTP_PORT": "0", "VOICE_AGENT_CACHE": str(tmp_path / "va")}  # fmt: skip
    log = tmp_path / "dev.log"
    exe = str(Path(sys.executable).with_name("voice-agent"))
    with open(log, "wb") as fh:  # stdout and stderr into one file
        proc = subprocess.Popen([exe, "dev", "--no-reload"], cwd=tmp_path, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT
        while "registered worker" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = log.read_text(errors="replace")
    assert text.count("registered worker") == 1, text[-3000:]
    twice = [line for line in text.splitlines() if OURS.match(line) and "livekit" in line]
    assert twice == [], twice  # LiveKit's lines went through voice-agent's handler too
