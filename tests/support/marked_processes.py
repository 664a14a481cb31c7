"""Find what a command started: every live process whose environment carries a marker variable
(the command's own, inherited by all it starts, services and their watchdogs included)."""

from __future__ import annotations

import psutil


def processes_with(var: str, value: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment has `var` = `value`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(var) == value and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found
