"""The BLAS thread count for a stretch of work, where the process runs OpenBLAS.

On Linux the engine preloads OpenBLAS for mlx's CPU matmuls (the `mlx-cpu` wheel links the
reference BLAS). OpenBLAS splits a matmul over threads once it has more than one row, and on
small matrices the hand-off costs more than it saves: its threads spin between calls and take
the cores from mlx's own thread. A talker step of the tiny checkpoint (64-wide matmuls, one row
per stream) ran 1.2-1.4x faster on 2 cores with one BLAS thread at 4 and 8 streams, and
the same at one stream; the vocoder's larger im2col matmuls ran 6-10 % faster with all threads,
and so did the real 0.6B talker's (1024 x 3072 MLP): a step 1.3 s on one thread, 0.8 s on two.
So, like PyTorch's grain size for its intra-op threads, one thread below a matrix size only.
Elsewhere (no OpenBLAS in the process: Accelerate on a Mac, CUDA) this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

# weight elements (rows x columns) under which a matmul runs on one thread: between the tiny
# checkpoint's 64 x 128 (faster on one) and the real talker's 1024 x 3072 (faster on all)
ONE_THREAD_BELOW = 512 * 512


def threads_for(weight_elements: int) -> int | None:
    """1 for a model whose largest matmul weight is small, None (leave BLAS alone) otherwise."""
    return 1 if weight_elements < ONE_THREAD_BELOW else None


@functools.cache
def _openblas():
    """OpenBLAS's (set, get) thread-count functions where the process has it, else None."""
    try:
        process = ctypes.CDLL(None)  # the symbols already loaded (LD_PRELOAD puts OpenBLAS here)
        setter, getter = process.openblas_set_num_threads, process.openblas_get_num_threads
    except (AttributeError, OSError, TypeError):  # TypeError: no CDLL(None) on Windows
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], None
    getter.argtypes, getter.restype = [], ctypes.c_int
    return setter, getter


def available() -> bool:
    return _openblas() is not None


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block's BLAS calls on at most `n` threads (None: as they are); the count before
    it is restored."""
    fns = _openblas() if n is not None else None
    if fns is None:
        yield
        return
    setter, getter = fns
    before = getter()
    if before == n:
        yield
        return
    setter(n)
    try:
        yield
    finally:
        setter(before)
