"""The process boundary: the server starts a worker process by the worker module's *name*.

The server process never imports mlx. `multiprocessing` pickles a process's target by
reference, so a target defined in `worker/` would make the server import it, and mlx with it.
`run_worker` lives here instead and imports the worker's entry point in the child, where it
runs; tests/engine/test_process_boundary.py checks that a serving server has no mlx loaded.

On Linux workers start from a fork server that has imported the worker's modules once
(`set_forkserver_preload`, as LiveKit's agent workers start their job processes): mlx,
mlx-audio, mlx-lm and transformers take ~4 s of CPU to import, which a spare worker, a swap
or a restart after a crash would otherwise pay each time. The fork server is a child of the
server process and ends with it. macOS keeps `spawn` (forking after Metal and the Objective-C
runtime are loaded is unsafe), as does QWEN3_TTS_WORKER_START=spawn. A forked worker takes the
server's environment as it is at the worker's start, not the fork server's (`run_worker`).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Connection

from qwen3_tts_engine.messages import WorkerSpec

WORKER_MODULE = "qwen3_tts_engine.worker.main"
START_ENV = "QWEN3_TTS_WORKER_START"  # "forkserver" (Linux default) or "spawn"


def start_method() -> str:
    method = os.environ.get(START_ENV) or (
        "forkserver" if sys.platform.startswith("linux") else "spawn"
    )
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV} must be forkserver or spawn, not {method!r}")
    return method


def run_worker(conn: Connection, spec: WorkerSpec | None, environ: dict[str, str] | None = None,
               module: str = WORKER_MODULE) -> None:  # fmt: skip
    """The started process's target (runs in the child only): `module`'s `worker_main`."""
    if environ is not None:  # forked: the server's environment now, not the fork server's
        os.environ.clear()
        os.environ.update(environ)
    importlib.import_module(module).worker_main(conn, spec)


def spawn_worker(spec: WorkerSpec | None, name: str, *,
                 module: str = WORKER_MODULE) -> tuple[mp.process.BaseProcess, Connection]:  # fmt: skip
    """A started worker process and the server's end of its pipe; `spec` None: a spare.
    `module`: the entry point's module (another one only in tests of the launch itself)."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":  # only takes effect before the fork server's first start
        ctx.set_forkserver_preload([WORKER_MODULE])
    parent, child = ctx.Pipe()
    environ = dict(os.environ) if method == "forkserver" else None
    proc = ctx.Process(
        target=run_worker, args=(child, spec, environ, module), daemon=True, name=name
    )
    proc.start()
    child.close()
    return proc, parent
