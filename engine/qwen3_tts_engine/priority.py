"""CPU priority of worker processes: niceness on every thread, and Linux's SCHED_IDLE.

The server lowers a loading worker's priority (a make-before-break swap loads next to a busy
worker) and raises it again once it serves; a spare worker waits idle-scheduled. A worker also
lowers its own priority at its start. Pure OS calls: used on both sides of the process boundary.
"""

from __future__ import annotations

import contextlib
import os


def renice(pid: int, value: int, *, idle: bool = False) -> bool:
    """Set a process's niceness on every one of its threads (Linux keeps niceness per thread:
    the BLAS threads a preloaded library starts before Python does would keep theirs). `idle`:
    also Linux's SCHED_IDLE policy (the threads run only on a CPU nothing else wants, and a waking
    normal thread preempts them at once), or back to SCHED_OTHER; only where this process may
    raise priorities again (`can_raise_priority`), so that a worker is never left idle-scheduled.
    Raising the priority needs CAP_SYS_NICE (root in a container); False where it is refused."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]  # no /proc (macOS): niceness is per process there
    policy = None
    if hasattr(os, "SCHED_IDLE") and can_raise_priority():
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                if policy is not None:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, value)
    except (PermissionError, OSError):
        return False
    return True


def can_raise_priority() -> bool:
    """Whether this process may lower a niceness again (root, or an RLIMIT_NICE that allows 0)."""
    if os.geteuid() == 0:
        return True
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except (ImportError, AttributeError, OSError, ValueError):
        return False
