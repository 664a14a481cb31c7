"""`qwen3-tts bench spawn`: what starting a handler worker costs besides loading its weights.

Every worker start, restart and swap pays it. Reported: the worker's spawn-to-ready time minus
its weight loading (and warm-up, which is off here), and the import of the worker's modules in a
fresh interpreter (time, module count, whether LiveKit came along). JSON on stdout."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.tiny_checkpoints import default_tiny_checkpoint

_IMPORT = ("import sys, time; t = time.perf_counter(); import qwen3_tts_engine.worker.main; "
           "import qwen3_tts_engine.worker.synthesis, qwen3_tts_engine.worker.loading; "
           "print(time.perf_counter() - t, len(sys.modules), "
           "any(m.split('.')[0] == 'livekit' for m in sys.modules))")  # fmt: skip


async def _overheads(model: str, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        handler = Handler(model, None, warmup=False)
        info = await handler.start()
        out.append(info["start_s"] - info["load_s"])
        await handler.stop()
    return out


def run_spawn_bench(args: argparse.Namespace) -> int:
    model = args.model or str(default_tiny_checkpoint())
    overheads = asyncio.run(_overheads(model, args.repeats))
    imports = []
    for _ in range(args.repeats):
        r = subprocess.run(
            [sys.executable, "-c", _IMPORT], capture_output=True, text=True, check=True
        )
        seconds, modules, livekit = r.stdout.split()
        imports.append((float(seconds), int(modules), livekit == "True"))
    result = {
        "model": model, "repeats": args.repeats,
        "spawn_to_ready_minus_load_s": {"median": statistics.median(overheads), "all": overheads},
        "worker_import_s": statistics.median(s for s, _, _ in imports),
        "worker_import_modules": imports[0][1],
        "worker_imports_livekit": any(lk for _, _, lk in imports),
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
