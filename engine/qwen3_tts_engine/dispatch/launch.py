"""The process boundary: the server starts a worker process by the worker module's *name*.

The server process never imports mlx. `multiprocessing` (spawn) pickles a process's target by
reference, so a target defined in `worker/` would make the server import it, and mlx with it.
`run_worker` lives here instead and imports the worker's entry point in the child, where it
runs; tests/engine/test_process_boundary.py checks that a serving server has no mlx loaded.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
from multiprocessing.connection import Connection

from qwen3_tts_engine.messages import WorkerSpec

WORKER_MODULE = "qwen3_tts_engine.worker.main"


def run_worker(conn: Connection, spec: WorkerSpec | None) -> None:
    """The spawned process's target (runs in the child only)."""
    importlib.import_module(WORKER_MODULE).worker_main(conn, spec)


def spawn_worker(spec: WorkerSpec | None, name: str) -> tuple[mp.process.BaseProcess, Connection]:
    """A started worker process and the server's end of its pipe; `spec` None: a spare."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_worker, args=(child, spec), daemon=True, name=name)
    proc.start()
    child.close()
    return proc, parent
