"""Starting a host-shared service: register this process as its first user, launch it, wait
until it answers, and record it; on any failure, undo all of it."""

from __future__ import annotations

import logging
import signal
import subprocess
import time

from voice_agent.services.progress import progress, wait_until_ready
from voice_agent.services.registry import cache_dir, join, kill_group, launch, leave, record_started

logger = logging.getLogger("voice_agent")


def start_service(key: str, cmd: list[str], log_name: str, ready_url: str, what: str, timeout: float,
                  port: int, env: dict | None = None, model: str | None = None) -> subprocess.Popen:  # fmt: skip
    """Start a host-shared service (under its host lock) with this process as its first user,
    wait until it answers and record it. On any failure, Ctrl-C or SIGTERM included, its whole
    process group is killed and this process leaves its users."""
    log = cache_dir() / log_name
    logger.info("starting %s: %s", what, " ".join(cmd))
    progress(f"starting {what} on port {port} (log: {log}) ...")
    t0 = time.monotonic()
    proc = None
    join(key)  # before the start: the watchdog keeps a service only while it has a live user
    try:
        with open(log, "ab") as fh:
            offset = fh.tell()  # earlier starts' lines are not this start's progress
            proc = launch(key, cmd, fh, env)
        wait_until_ready(ready_url, proc, what, timeout, log, port, offset)
        record_started(key, proc.pid, model)
        progress(f"{what} is ready ({time.monotonic() - t0:.0f} s)")
    except BaseException:
        if proc is not None:
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        leave(key)
        raise
    return proc
