"""Free-running generation of codes (no vocoder) and how a candidate's run departs from the reference's."""

from __future__ import annotations

import numpy as np

from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.runtime.synthesis import SynthesisStats, _check_request, _frames


def generate_codes(model, req: SpeechRequest) -> tuple[np.ndarray, bool]:
    """Codes [T, 16] for `req.input` as one prompt (no sentence split), and whether T hit the cap."""
    import mlx.core as mx

    voice, instruct = _check_request(model, req)
    options = model._resolve_generation_options(
        req.temperature, None, req.top_k, req.top_p, req.repetition_penalty
    )
    if req.seed is not None:
        mx.random.seed(req.seed)
    stats = SynthesisStats()
    frames = [np.array(f[0]) for f in _frames(model, req.input, req, voice, instruct, None,
                                              options, lambda: False, stats)]  # fmt: skip
    codes = np.stack(frames).astype(np.int32) if frames else np.zeros((0, 16), np.int32)
    return codes, stats.hit_token_cap


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
