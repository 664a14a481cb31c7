"""The engine's process boundary, at run time: `qwen3-tts serve` started from a shell that never
sourced anything serves with mlx (and OpenBLAS, on Linux) loaded in its worker process only.

The import contracts (pyproject.toml) hold the same boundary in the code; this checks what a
real server process has mapped, so a start-up path that imports mlx anyway (a default
checkpoint written in-process, a stray import) shows here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.engine_process import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")

QWEN3_TTS = Path(sys.executable).with_name("qwen3-tts")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _libraries(maps: str) -> set[str]:
    return {line.split()[-1] for line in maps.splitlines() if line.split()[-1].startswith("/")}


def test_serve_from_a_clean_environment_loads_mlx_and_openblas_in_its_worker_only(
    tiny_checkpoint, tmp_path
):
    model, port = tiny_checkpoint("custom_voice", eos="text"), free_port()
    # what a login shell has, and nothing this test session set (no LD_PRELOAD, no venv)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    assert "LD_PRELOAD" not in env
    proc = subprocess.Popen([str(QWEN3_TTS), "serve", "--model", str(model), "--port", str(port)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):  # up to ~10 min on a busy machine; ends at the first 200
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        status = httpx.get(f"{url}/v1/engine/status", timeout=30).json()
        worker = status["handlers"][0]["pid"]
        r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hello there.", "max_new_tokens": 8,
                                                       "response_format": "pcm"}, timeout=300)  # fmt: skip
        assert r.status_code == 200 and len(r.content) > 0
        server_libs, worker_libs = _libraries(_maps(proc.pid)), _libraries(_maps(worker))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    mlx_in = lambda libs: [lib for lib in libs if "/mlx/" in lib or "libmlx" in lib]  # noqa: E731
    blas_in = lambda libs: [lib for lib in libs if "openblas" in lib.lower() and "numpy" not in lib]  # noqa: E731
    assert mlx_in(worker_libs), "the check reads the worker's process"
    assert not mlx_in(server_libs), mlx_in(server_libs)
    print(f"\nworker BLAS: {blas_in(worker_libs)}")
    assert blas_in(worker_libs), "the worker runs mlx on the reference BLAS (no OpenBLAS loaded)"
    assert not blas_in(server_libs)
