"""The Prometheus multiprocess directory of a `voice-agent start|dev` worker.

prometheus-client picks its value store when it is imported: every process whose metrics the
worker's `/metrics` aggregates (the main process with LiveKit's job gauges, and each job process
with the turn metrics) must see PROMETHEUS_MULTIPROC_DIR before that import. This module imports
nothing that imports it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile


def use_multiprocess_dir() -> str | None:
    """Before prometheus_client is imported: give this process and its children (LiveKit's job
    processes) a fresh PROMETHEUS_MULTIPROC_DIR, unless one is set; removed at exit. Returns it."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return os.environ["PROMETHEUS_MULTIPROC_DIR"]
    if "prometheus_client" in sys.modules:
        raise RuntimeError(
            "prometheus_client was imported before its multiprocess directory was set"
        )
    path = tempfile.mkdtemp(prefix="voice-agent-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
