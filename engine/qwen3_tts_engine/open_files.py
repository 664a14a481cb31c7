"""mlx-lm, when imported, sets the process's open-file limit to (2048, 4096) (`mlx_lm/utils.py`,
at module level): a server's process loses the limit its host gave it, a hard limit can only be
lowered, and on a host whose hard limit is below 4096 the import raises. mlx-audio imports
mlx-lm, so every process that runs Qwen3-TTS would. Importing it through `import_mlx_lm` first
keeps the process's own limit."""

from __future__ import annotations

import resource
import sys


def import_mlx_lm() -> None:
    """Import mlx_lm with its change of RLIMIT_NOFILE skipped (any other limit is left to it)."""
    if "mlx_lm.utils" in sys.modules:
        return
    real = resource.setrlimit

    def everything_but_open_files(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = everything_but_open_files
    try:
        import mlx_lm.utils  # noqa: F401 (its import-time setrlimit is what is skipped)
    finally:
        resource.setrlimit = real
