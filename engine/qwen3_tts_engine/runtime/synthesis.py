"""Frame-level Qwen3-TTS synthesis on a loaded mlx-audio model, streamed in 4-frame chunks.

mlx-audio's `generate()` fixes the chunk size for a whole utterance; this loop reuses its model
pieces (prompt building, talker, code predictor, sampler, stateful vocoder) so that the first
chunk can be smaller, long input runs sentence by sentence through one continuous vocoder state,
and a caller can stop between any two frames. Runs in the handler's worker process only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from qwen3_tts_engine.protocol import CHUNK_FRAMES, SpeechRequest, default_max_new_tokens

from .sentences import split_sentences as _split


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


def _frames(model, text, req, voice, instruct, ref_audio, options, should_stop, stats):
    """Yield [1, 16] code arrays, one per 80 ms frame, until EOS, the cap, or should_stop()."""
    talker = model.talker
    config = model.config.talker_config
    eos = config.codec_eos_token_id
    suppress = [i for i in range(config.vocab_size - 1024, config.vocab_size) if i != eos]
    max_frames = req.max_new_tokens or default_max_new_tokens(text)
    rep_penalty = options["repetition_penalty"]
    if ref_audio is not None and req.ref_text:
        rep_penalty = max(rep_penalty, 1.5)  # as mlx-audio's ICL path: long prefills degenerate

    input_embeds, trailing, pad_embed = _prefill(model, text, req, voice, instruct, ref_audio)
    cache = talker.make_cache()
    code_cache = talker.code_predictor.make_cache()
    history: list[int] = []
    embed_codec = talker.get_input_embeddings()
    for step in range(max_frames):
        if should_stop():
            stats.cancelled = True
            return
        logits, hidden = talker(input_embeds, cache=cache)
        token = model._sample_token(
            logits, temperature=options["temperature"], top_k=options["top_k"],
            top_p=options["top_p"], repetition_penalty=rep_penalty,
            generated_tokens=history or None, suppress_tokens=suppress,
        )  # fmt: skip
        is_eos = token[0, 0] == eos
        for c in code_cache:
            c.keys, c.values, c.offset = None, None, 0
        codes = [token]
        code_input = mx.concatenate([hidden[:, -1:, :], embed_codec(token)], axis=1)
        for group in range(config.num_code_groups - 1):
            if group > 0:
                code_input = talker.code_predictor.codec_embedding[group - 1](codes[-1])
            code_logits, code_cache, _ = talker.code_predictor(
                code_input, cache=code_cache, generation_step=group
            )
            codes.append(model._sample_token(
                code_logits, temperature=options["temperature"], top_k=options["top_k"],
                top_p=options["top_p"],
            ))  # fmt: skip
        text_embed = trailing[:, step : step + 1, :] if step < trailing.shape[1] else pad_embed
        codec_embed = embed_codec(token)
        for i, code in enumerate(codes[1:]):
            codec_embed = codec_embed + talker.code_predictor.codec_embedding[i](code)
        input_embeds = text_embed + codec_embed
        mx.eval(input_embeds, is_eos)
        if is_eos.item():
            return
        history.append(int(token[0, 0]))
        yield mx.concatenate(codes, axis=1)  # [1, 16]
    stats.hit_token_cap = True


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

    Sentences are generated one after another into one vocoder stream, so chunks keep their
    size across sentence boundaries and only the very last chunk may be shorter. With
    `decode=False` only codes are made (empty audio): for evaluations that compare codes.
    """
    if model.speech_tokenizer is None or model.tokenizer is None:
        raise SynthesisError("the checkpoint's tokenizer or speech tokenizer failed to load")
    stats = stats if stats is not None else SynthesisStats()
    voice, instruct = _check_request(model, req)
    options = model._resolve_generation_options(
        req.temperature, None, req.top_k, req.top_p, req.repetition_penalty
    )
    if req.seed is not None:
        mx.random.seed(req.seed)
    decoder = model.speech_tokenizer.decoder
    decoder.reset_streaming_state()

    target = req.first_chunk_frames or CHUNK_FRAMES
    pending: list[mx.array] = []
    started = time.perf_counter()

    def flush() -> Chunk:
        nonlocal pending, started, target
        codes = mx.stack(pending, axis=1)  # [1, n, 16]
        if decode:
            wav = decoder.streaming_step(mx.transpose(codes, (0, 2, 1)))
            audio = np.array(wav.squeeze(1)[0].astype(mx.float32), copy=False)
        else:
            audio = np.zeros(0, np.float32)
        chunk = Chunk(audio, len(pending), time.perf_counter() - started,
                      np.array(codes[0]) if keep_codes or not decode else None)  # fmt: skip
        stats.chunk_frames.append(len(pending))
        pending, target = [], CHUNK_FRAMES
        return chunk

    for sentence in split_sentences(req.input):
        stats.sentences += 1
        for frame in _frames(model, sentence, req, voice, instruct, ref_audio, options,
                             should_stop, stats):  # fmt: skip
            pending.append(frame)
            stats.frames += 1
            if len(pending) == target:
                yield flush()
                started = time.perf_counter()  # the consumer's time is not this chunk's compute
        if stats.cancelled:
            return
    if pending:
        yield flush()


def one_shot_decode(model, codes: np.ndarray) -> np.ndarray:
    """Decode [frames, 16] codes in one vocoder call (the reference for the no-seams check)."""
    arr = mx.array(codes)[None].transpose(0, 2, 1)  # [1, 16, frames]
    wav = model.speech_tokenizer.decoder(arr)
    return np.array(wav.squeeze(1)[0].astype(mx.float32))
