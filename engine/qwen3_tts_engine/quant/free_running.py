"""Free-running generation of codes (no vocoder) and how a candidate's run departs from the reference's."""

from __future__ import annotations

import numpy as np

from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.worker.scheduler import Scheduler


def generate_codes(model, req: SpeechRequest) -> tuple[np.ndarray, bool]:
    """Codes [T, 16] for `req.input` as one prompt (no sentence split), and whether T hit the cap."""
    return generate_codes_batched(model, [req], max_batch=1)[0]


def generate_codes_batched(
    model, reqs: list[SpeechRequest], *, max_batch: int = 8
) -> list[tuple[np.ndarray, bool]]:
    """`generate_codes` for each request, in order, `max_batch` at a time in one batch (as the
    engine batches streams): what GPTQ calibrates on, many frames, at a fraction of the steps."""
    scheduler = Scheduler(model, max_batch=max_batch)
    streams = [scheduler.add(str(i), req, decode=False, split=False) for i, req in enumerate(reqs)]
    chunks: dict[str, list[np.ndarray]] = {s.id: [] for s in streams}
    open_ids = set(chunks)
    while open_ids:
        for event in scheduler.step():
            if event.kind == "chunk":
                chunks[event.stream.id].append(event.chunk.codes)
            elif event.kind == "error":
                raise event.error
            else:
                open_ids.discard(event.stream.id)
    empty = np.zeros((0, 16), np.int32)
    return [(np.concatenate(chunks[s.id]).astype(np.int32) if chunks[s.id] else empty,
             s.stats.hit_token_cap) for s in streams]  # fmt: skip


def first_divergence(ref: np.ndarray, cand: np.ndarray) -> int:
    """Index of the first frame whose 16 codes differ; the common length when one is a prefix."""
    n = min(len(ref), len(cand))
    differ = np.nonzero(np.any(ref[:n] != cand[:n], axis=1))[0]
    return int(differ[0]) if differ.size else n


def compare_runs(ref: np.ndarray, cand: np.ndarray, cand_hit_cap: bool, ref_hit_cap: bool) -> dict:
    """Runaway counts runs that hit the token cap although the reference stopped by itself."""
    return {
        "length_ratio": len(cand) / max(len(ref), 1),
        "runaway_rate": float(cand_hit_cap and not ref_hit_cap),
        "first_divergence": float(first_divergence(ref, cand)),
    }
