"""Frame-level Qwen3-TTS synthesis on a loaded mlx-audio model, streamed in 4-frame chunks.

mlx-audio's `generate()` fixes the chunk size for a whole utterance; this loop reuses its model
pieces (prompt building, talker, code predictor, sampler, stateful vocoder) so that the first
chunk can be smaller, long input runs sentence by sentence through one continuous vocoder state,
and a caller can stop between any two frames. Runs in the handler's worker process only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from qwen3_tts_engine.protocol import SpeechRequest

from .sentences import split_sentences as _split
from .vocoder import windowed_decode


class SynthesisError(ValueError):
    """The request cannot be served by this model (unknown voice, missing instructions...)."""


@dataclass
class Chunk:
    audio: np.ndarray  # float32 in [-1, 1]
    frames: int
    compute_s: float  # wall time spent on this chunk's frames and its vocoder step
    codes: np.ndarray | None = None  # [frames, 16] when requested


@dataclass
class SynthesisStats:
    frames: int = 0
    sentences: int = 0
    hit_token_cap: bool = False
    cancelled: bool = False
    chunk_frames: list[int] = field(default_factory=list)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` as LiveKit's basic tokenizer cuts them (short ones are merged)."""
    parts = [s.strip() for s in _split(text, min_sentence_len=20)]
    return [p for p in parts if p] or [text.strip()]


def model_info(model) -> dict:
    talker = model.config.talker_config
    return {
        "tts_model_type": model.config.tts_model_type,
        "tts_model_size": model.config.tts_model_size,
        "voices": sorted((talker.spk_id or {}).keys()),
        "languages": ["auto", *sorted((talker.codec_language_id or {}).keys())],
        "sample_rate": model.sample_rate,
        "can_clone": model.speech_tokenizer is not None and model.speech_tokenizer.has_encoder,
    }


def _check_request(model, req: SpeechRequest) -> tuple[str | None, str | None]:
    """Voice and instruct the model will use, or SynthesisError naming what is wrong."""
    kind = model.config.tts_model_type
    if req.task_type is not None and req.task_type != kind:
        raise SynthesisError(f"this model is {kind!r}; task_type {req.task_type!r} needs another")
    speakers = {s.lower(): s for s in (model.config.talker_config.spk_id or {})}
    voice = req.voice.lower() if req.voice else None
    instruct = req.instructions or None
    if kind == "custom_voice":
        if voice is None:
            voice = sorted(speakers)[0] if speakers else None
        if voice not in speakers:
            raise SynthesisError(f"unknown voice {req.voice!r}; voices: {', '.join(sorted(speakers))}")
        if model.config.tts_model_size == "0b6":
            instruct = None  # the 0.6B CustomVoice models were not trained with instructions
    elif kind == "voice_design":
        if not instruct:
            raise SynthesisError("a VoiceDesign model needs `instructions` describing the voice")
        voice = None
    else:  # base
        if voice is not None and voice not in speakers:
            raise SynthesisError(
                f"voice {req.voice!r}: Base models have no preset voices; send ref_audio "
                "(and ref_text for in-context cloning) instead"
            )
    if req.language != "auto":
        known = model.config.talker_config.codec_language_id or {}
        if req.language not in known:
            raise SynthesisError(f"language {req.language!r} is not supported by this model")
    return voice, instruct


def _prefill(model, text: str, req: SpeechRequest, voice, instruct, ref_audio):
    if ref_audio is not None and req.ref_text and model.config.tts_model_type == "base":
        if not model.speech_tokenizer.has_encoder:
            raise SynthesisError("this checkpoint has no speech-tokenizer encoder: cannot clone")
        embeds, trailing, pad, _ref_codes = model._prepare_icl_generation_inputs(
            text=text, ref_audio=ref_audio, ref_text=req.ref_text, language=req.language
        )
        return embeds, trailing, pad
    return model._prepare_generation_inputs(
        text=text, language=req.language, speaker=voice, ref_audio=ref_audio, instruct=instruct
    )


def stream_chunks(
    model,
    req: SpeechRequest,
    *,
    ref_audio: mx.array | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    keep_codes: bool = False,
    decode: bool = True,
    stats: SynthesisStats | None = None,
) -> Iterator[Chunk]:
    """Synthesize `req.input`, yielding chunks of 4 frames (the first may be 1 or 2 frames).

    One request through a scheduler of its own (`scheduler.py`), so it gives what the same
    request gives on a server next to others. Sentences are generated one after another into
    one vocoder stream, so chunks keep their size across sentence boundaries and only the very
    last chunk may be shorter. With `decode=False` only codes are made (empty audio): for
    evaluations that compare codes. `should_stop()` is asked before every frame.
    """
    from .scheduler import Scheduler

    scheduler = Scheduler(model, max_batch=1)
    scheduler.add("solo", req, ref_audio=ref_audio, keep_codes=keep_codes, decode=decode, stats=stats)
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
