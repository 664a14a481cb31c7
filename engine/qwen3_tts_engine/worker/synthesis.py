"""Frame-level Qwen3-TTS synthesis on a loaded mlx-audio model, streamed in 4-frame chunks.

mlx-audio's `generate()` fixes the chunk size for a whole utterance; this loop reuses its model
pieces (prompt building, talker, code predictor, sampler, stateful vocoder) so that the first
chunk can be smaller, long input runs sentence by sentence through one continuous vocoder state,
and a caller can stop between any two frames. Runs in the handler's worker process only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np

from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES, LoopRules
from qwen3_tts_engine.worker.scheduler import Chunk, Scheduler, SynthesisStats
from qwen3_tts_engine.worker.vocoder import windowed_decode

__all__ = ["Chunk", "SynthesisStats", "one_shot_decode", "stream_chunks"]


def stream_chunks(
    model,
    req: SpeechRequest,
    *,
    ref_audio: mx.array | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    keep_codes: bool = False,
    decode: bool = True,
    stats: SynthesisStats | None = None,
    loop_rules: LoopRules | None = DEFAULT_LOOP_RULES,
) -> Iterator[Chunk]:
    """Synthesize `req.input`, yielding chunks of 4 frames (the first may be 1 or 2 frames).

    One request through a scheduler of its own (`scheduler.py`), so it gives what the same
    request gives on a server next to others. Sentences are generated one after another into
    one vocoder stream, so chunks keep their size across sentence boundaries and only the very
    last chunk may be shorter. With `decode=False` only codes are made (empty audio): for
    evaluations that compare codes. `should_stop()` is asked before every frame. `loop_rules`
    None switches the loop detector off (`loop_detector.py`).
    """
    scheduler = Scheduler(model, max_batch=1, loop_rules=loop_rules)
    scheduler.add(
        "solo", req, ref_audio=ref_audio, keep_codes=keep_codes, decode=decode, stats=stats
    )
    while True:
        if should_stop():
            scheduler.cancel("solo")
        for event in scheduler.step():
            if event.kind == "chunk":
                yield event.chunk
            elif event.kind == "error":
                raise event.error
            else:
                return


def one_shot_decode(model, codes: np.ndarray) -> np.ndarray:
    """Decode [frames, 16] codes in one vocoder call with the decoder's sliding attention window
    (the reference for the no-seams check)."""
    arr = mx.array(codes)[None].transpose(0, 2, 1)  # [1, 16, frames]
    return np.array(windowed_decode(model.speech_tokenizer.decoder, arr))
