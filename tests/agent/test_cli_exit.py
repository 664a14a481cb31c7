"""`voice-agent` ends cleanly once LiveKit's native library is loaded: the demo's error path that
loads it (a WAV resampled by LiveKit's FFI, then an --out that cannot be written) run many times
exits with its code and its one line every time, never with LiveKit's FFI thread aborting the
process at exit ("panic in a function that cannot unwind", exit 134: a native thread calling into
the interpreter while it finalized; cli._exit_past_livekit)."""

from __future__ import annotations

import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

EXE = str(Path(sys.executable).with_name("voice-agent"))
RUNS = 20  # the abort was seen about once in 30 runs before the fix


def _tone_wav(path: Path) -> Path:
    t = np.arange(16000) / 16000  # 16 kHz: the demo resamples it with LiveKit's FFI resampler
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes())
    return path


@pytest.mark.slow
def test_the_demo_exits_cleanly_after_livekits_ffi_was_loaded(tmp_path):
    wav = _tone_wav(tmp_path / "turn.wav")
    (tmp_path / "afile").write_text("")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
           "VOICE_AGENT_CACHE": str(tmp_path / "cache")}  # fmt: skip
    want = "voice-agent: error: --out afile/x.wav: afile is not a directory"
    for run in range(RUNS):
        p = subprocess.run([EXE, "demo", str(wav), "--out", "afile/x.wav"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        out = f"run {run}: exit {p.returncode}\n{p.stderr}"
        assert p.returncode == 1, out
        assert "panicked" not in p.stderr and "Traceback" not in p.stderr, out
        assert p.stderr.strip() == want, out
    # the path did load LiveKit's FFI (else this test would show nothing)
    probe = ("import sys; sys.argv[1:] = ['demo', 'turn.wav', '--out', 'afile/x.wav']\n"
             "from voice_agent import cli; import livekit.rtc._ffi_client as f\n"
             "try:\n    cli._main(None)\nexcept RuntimeError: pass\n"
             "print(f.FfiClient._instance is not None)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.stdout.strip().splitlines()[-1] == "True", p.stderr[-2000:]
