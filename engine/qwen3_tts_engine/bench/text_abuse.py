"""Another caller's first audio beside 10,000 one-character appends of CJK text (issue 50).

`python -m qwen3_tts_engine.bench.text_abuse [--model DIR] [--rounds N] [--pieces N]`: one
engine in this process (a real worker process, its pipe and scheduler; no HTTP), two batch rows,
no frame budget. Each round runs the caller alone ("alone"), then beside an abuser whose streamed
text is `--pieces` one-character pieces of Chinese with no punctuation, sent as fast as the event
loop allows, in bursts of 100 ("abused": the caller starts after the first burst). The caller's
first audio is timed from its request on one clock; the abuser's appends from its first to its
last (the server's side: what its socket door would do). JSON on stdout, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time

from qwen3_tts_engine import Engine, Handler
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import SpeechRequest

CALLER_TEXT = "Hello there, how are you today?"
BURST = 100


async def _first_audio(engine: Engine, seed: int) -> float:
    t0 = time.perf_counter()
    req = SpeechRequest(input=CALLER_TEXT, voice="ryan", language="english", seed=seed)
    async with contextlib.aclosing(engine.stream(req)) as chunks:
        async for _ in chunks:
            first = time.perf_counter() - t0
            break
    return first


async def _abused(engine: Engine, seed: int, pieces: int) -> dict:
    rng = random.Random(seed)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(pieces))
    text = TextInput()
    abuser = engine.stream(SpeechRequest(input="", voice="ryan", seed=seed, text_stream=True),
                           text=text)  # fmt: skip

    async def drain() -> None:
        async for _ in abuser:
            pass

    reader = asyncio.create_task(drain())
    caller: asyncio.Task | None = None
    t0 = time.perf_counter()
    for i in range(0, pieces, BURST):
        for ch in cjk[i : i + BURST]:
            text.append(ch)
        if caller is None:
            caller = asyncio.create_task(_first_audio(engine, seed))
        await asyncio.sleep(0)
    appends_s = time.perf_counter() - t0
    first = await caller
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    await abuser.aclose()
    stats = engine.active.last_stats or {}
    return {"first_audio_s": first, "appends_s": appends_s,
            "text_reread_max": stats.get("text_reread_max"),
            "text_forced_commits": stats.get("text_forced_commits")}  # fmt: skip


async def _run(model: str, rounds: int, pieces: int) -> dict:
    engine = Engine(model, [Handler(model, max_batch=2, frame_budget_s=None)])
    await engine.start()
    alone, abused = [], []
    try:
        await _first_audio(engine, 0)  # warm
        for r in range(rounds):
            alone.append(await _first_audio(engine, r + 1))
            abused.append(await _abused(engine, r + 1, pieces))
    finally:
        await engine.stop()
    firsts = [a["first_audio_s"] for a in abused]
    return {
        "pieces": pieces,
        "rounds": rounds,
        "first_audio_alone_s": [round(x, 3) for x in alone],
        "first_audio_abused_s": [round(x, 3) for x in firsts],
        "median_alone_s": round(statistics.median(alone), 3),
        "median_abused_s": round(statistics.median(firsts), 3),
        "ratio_abused_to_alone": round(statistics.median(firsts) / statistics.median(alone), 2),
        "abuser": abused,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a tiny one, eos by text)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pieces", type=int, default=10_000)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        import tempfile
        from pathlib import Path

        from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint

        model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", eos="text"))
    report = asyncio.run(_run(model, args.rounds, args.pieces))
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
