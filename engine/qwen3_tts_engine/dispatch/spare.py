"""A spare worker: a worker process started before a swap needs it (`Handler.start(spare=...)`)."""

from __future__ import annotations

import contextlib

from qwen3_tts_engine.dispatch.launch import spawn_worker
from qwen3_tts_engine.messages import SpareReady
from qwen3_tts_engine.priority import renice

SPARE_NICE = 19  # a spare's imports yield the CPU to every worker that serves


class SpareWorker:
    """A handler worker started before it is needed: its interpreter up and the modules that
    loading imports imported (most of a worker's start on a CPU), no model. A swap hands it its
    spec (`Handler.start(spare=...)`), so the new worker's CPU during the swap is its weights and
    warm-up. It waits at the lowest priority (idle-scheduled on Linux); ~90 MB of memory."""

    def __init__(self) -> None:
        self.proc, self.conn = spawn_worker(None, "qwen3-tts-worker spare")
        renice(self.proc.pid, SPARE_NICE, idle=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> bool:
        """Until its imports are done (blocks: run in a thread). False on timeout or death."""
        try:
            return self.conn.poll(timeout) and isinstance(self.conn.recv(), SpareReady)
        except (EOFError, OSError):
            return False

    def take(self, nice: int) -> bool:
        """Ready to be a handler's worker at niceness `nice` (False: gone, or the OS refused the
        higher priority, which needs CAP_SYS_NICE: then a fresh worker is spawned instead)."""
        return self.proc.is_alive() and renice(self.proc.pid, nice, idle=nice > 0)

    def close(self) -> None:
        """End it unused (blocks up to ~4 s: run in a thread)."""
        with contextlib.suppress(OSError):
            self.conn.close()  # EOF: the spare returns
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
