"""mlx-lm lowers the open-file limit at import (to 2048/4096, `mlx_lm/utils.py`): the processes
that run Qwen3-TTS keep the one they started with (qwen3_tts_engine/open_files.py)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import httpx
import psutil

from tests.support.engine_process import free_port

LIMITS = (3000, 5000)  # neither of mlx-lm's values


def _with_limits(*argv: str) -> list[str]:
    """argv run with RLIMIT_NOFILE set to LIMITS first (as a host or a service manager would)."""
    code = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, {LIMITS!r}); "
            "os.execv(sys.argv[1], sys.argv[1:])")  # fmt: skip
    return [sys.executable, "-c", code, *argv]


def test_importing_mlx_audio_keeps_the_limit():
    code = (
        "from qwen3_tts_engine.open_files import import_mlx_lm; import_mlx_lm(); "
        "import mlx_audio.tts.utils, mlx_lm, resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run(
        _with_limits(sys.executable, "-c", code), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(LIMITS)
    plain = subprocess.run(_with_limits(sys.executable, "-c", "import mlx_lm, resource; "
                                        "print(resource.getrlimit(resource.RLIMIT_NOFILE))"),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert plain.stdout.strip().splitlines()[-1] == "(2048, 4096)"  # what is kept from happening


def test_an_engine_workers_open_file_limit_is_its_parents(tiny_checkpoint):
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "qwen3-tts")
    server = subprocess.Popen(_with_limits(exe, "serve", "--model", str(tiny_checkpoint()), "--port", str(port)),
                              env={**os.environ, "QWEN3_TTS_LOG_LEVEL": "WARNING"}, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a bound only a hang reaches
        while True:
            assert server.poll() is None, f"engine exited with {server.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the engine did not get ready"
            time.sleep(0.2)
        parent = psutil.Process(server.pid)
        workers = [p for p in parent.children(recursive=True) if "python" in p.name().lower()]
        assert workers, parent.children(recursive=True)
        assert parent.rlimit(psutil.RLIMIT_NOFILE) == LIMITS
        for (
            worker
        ) in workers:  # the loaded worker (and a spare, if any) imported mlx-audio and mlx-lm
            assert worker.rlimit(psutil.RLIMIT_NOFILE) == LIMITS, worker.cmdline()
    finally:
        os.killpg(server.pid, 9)
        server.wait(30)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) != (
        2048,
        4096,
    )  # nor this test process's (conftest)
