"""A fast BLAS for mlx's CPU backend on Linux, without a step the user has to take.

The `mlx-cpu` wheel links the netlib reference BLAS: fp32 matmuls ran at ~4 GFLOP/s on the test
machines, against ~47 GFLOP/s with Debian's OpenBLAS, and the first audio of `qwen3-tts serve`
was ~6x slower (docs/benchmarks.md). Loading OpenBLAS into the process with `RTLD_GLOBAL` before
mlx's core library loads makes mlx's BLAS symbols resolve to it, as `LD_PRELOAD` would.
Every package that runs mlx calls `use_fast_blas()` before importing it (`worker/`, `quant/`,
`bench/`, `tiny_checkpoints/`); the server process, which never imports mlx, does not load it.
Nothing happens on macOS (mlx runs on Metal and Accelerate there), where no OpenBLAS is
installed, where one is loaded already (the container images set `LD_PRELOAD`), or with
`QWEN3_TTS_BLAS=reference`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

ENV = "QWEN3_TTS_BLAS"  # "reference": keep the BLAS the mlx wheel links
_CANDIDATES = ("/usr/lib/*/libopenblas.so.0", "/usr/lib/*/openblas-pthread/libopenblas.so.0",
               "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0")  # fmt: skip
_loaded: str | None = None


def openblas_path() -> str | None:
    """Where the system's OpenBLAS is (Debian's `libopenblas0-pthread`), if it is installed."""
    for pattern in _CANDIDATES:
        if found := sorted(glob.glob(pattern)):
            return found[0]
    return None


def use_fast_blas() -> str | None:
    """Load OpenBLAS for mlx if this process can still use it; returns its path, or None."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux") or os.environ.get(ENV) == "reference":
        return None
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        _loaded = os.environ["LD_PRELOAD"]
        return _loaded
    if "mlx.core" in sys.modules:
        return None  # too late: mlx's symbols are bound (the caller imported mlx first)
    path = openblas_path()
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded = path
    return path


def environment_for_child(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with OpenBLAS preloaded, for a child that runs mlx code we
    do not own (`mlx_lm.server`)."""
    env = dict(os.environ if env is None else env)
    path = (
        openblas_path()
        if sys.platform.startswith("linux") and env.get(ENV) != "reference"
        else None
    )
    if path and "openblas" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD")) if p)
    return env
