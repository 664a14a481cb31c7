"""A stand-in worker entry point for tests of dispatch/launch.py: it says where it runs and
what it sees, then waits for its pipe to close (as a real worker does when its server goes)."""

from __future__ import annotations

import os
import sys


def worker_main(conn, spec) -> None:
    conn.send({"pid": os.getpid(), "ppid": os.getppid(), "mark": os.environ.get("LAUNCH_PROBE_MARK"),
               "worker_preloaded": "qwen3_tts_engine.worker.main" in sys.modules,
               "mlx": "mlx.core" in sys.modules})  # fmt: skip
    try:
        conn.recv()
    except EOFError:
        pass
