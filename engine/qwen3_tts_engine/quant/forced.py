"""Teacher forcing: a model's next-token distributions along codes another model generated.

One talker pass over the prompt plus all reference frames gives codebook 0's distribution at
every step (and after the last frame, where the reference stopped); one code-predictor pass over
all frames at once gives the 15 heads'. The inputs are built exactly as the scheduler's steps build
them (worker/scheduler.py), so forced along its own codes a model gives the logits its sampler saw.
Distributions are the model's own (temperature 1, no top-k/top-p or repetition penalty) over the
tokens the sampler may pick (codebook 0's control tokens other than EOS are suppressed).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.rules import ModelInfo, check_request, text_mode_for
from qwen3_tts_engine.worker.loading import describe
from qwen3_tts_engine.worker.text_track import TextTrack


@dataclass
class Forced:
    cb0: (
        np.ndarray
    )  # [T+1, allowed] log-probabilities of codebook 0 (last row: after the last frame)
    cp: np.ndarray  # [T, 15, vocab] log-probabilities of the code-predictor heads
    eos: np.ndarray  # [T+1] probability of the end-of-speech token


def _allowed_cb0(config) -> np.ndarray:
    """Codebook-0 ids the sampler can emit: codec tokens and EOS (the rest is suppressed)."""
    v = config.vocab_size
    return np.array([*range(v - 1024), config.codec_eos_token_id])


def _log_softmax(x: mx.array) -> np.ndarray:
    x = x.astype(mx.float32)
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


def teacher_forced(model, req: SpeechRequest, codes: np.ndarray) -> Forced:
    """Distributions of `model` along `codes` [T, 16] for the prompt of `req` (one text)."""
    info = ModelInfo.from_info(describe(model))
    voice = check_request(req, info)
    track = TextTrack(model, req, text_mode_for(req, info), text=req.input)
    embeds = track.prompt(voice, None)
    talker = model.talker
    cfg = model.config.talker_config
    embed0 = talker.get_input_embeddings()
    cp = talker.code_predictor
    c = mx.array(codes.astype(np.int32))  # [T, 16]
    n = c.shape[0]
    groups = cfg.num_code_groups - 1

    # Step t+1's input: the text position t (or padding) plus the sum of frame t's code embeddings.
    codec = embed0(c[:, 0])
    for i in range(groups):
        codec = codec + cp.codec_embedding[i](c[:, i + 1])
    # The text term of each step, as the scheduler feeds it (a whole text never waits).
    steps = codec + mx.concatenate([track.term(t)[0] for t in range(n)], axis=0) if n else codec
    seq = mx.concatenate([embeds, steps[None].astype(embeds.dtype)], axis=1)
    hidden = talker.model(seq)
    start = embeds.shape[1] - 1
    # Only the steps that emit a frame go through the head (GPTQ calibrates on exactly these).
    cb0_logits = talker.codec_head(hidden[0, start:])  # [T+1, vocab]
    allowed = _allowed_cb0(cfg)
    cb0 = _log_softmax(cb0_logits[:, mx.array(allowed)])
    eos = np.exp(cb0[:, -1])  # EOS is the last allowed column

    # Code predictor: per frame [hidden_t, emb0(c0), emb_1(c1) .. emb_14(c14)], causal.
    if n == 0:
        return Forced(cb0, np.zeros((0, groups, cp.config.vocab_size), np.float32), eos)
    parts = [hidden[0, start : start + n][:, None], embed0(c[:, 0])[:, None]]
    parts += [cp.codec_embedding[i](c[:, i + 1])[:, None] for i in range(groups - 1)]
    x = mx.concatenate(parts, axis=1)  # [T, 16, D]
    if cp.small_to_mtp_projection is not None:
        x = cp.small_to_mtp_projection(x)
    h = cp.model(x)
    heads = mx.stack([cp.lm_head[g](h[:, g + 1]) for g in range(groups)], axis=1)  # [T, 15, V]
    return Forced(cb0, _log_softmax(heads), eos)


def _kl(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """KL(ref || cand) over the last axis, from log-probabilities."""
    return np.sum(np.exp(ref) * (ref - cand), axis=-1).clip(min=0.0)


def compare_forced(ref: Forced, cand: Forced) -> dict:
    """Per-item teacher-forced metrics of `cand` against `ref` (same codes)."""
    cp_kl = _kl(ref.cp, cand.cp)  # [T, 15]
    return {
        "cb0_kl": float(_kl(ref.cb0, cand.cb0).mean()),
        "cb0_top1": float((ref.cb0.argmax(-1) == cand.cb0.argmax(-1)).mean()),
        "cp_kl": float(cp_kl.mean()) if cp_kl.size else 0.0,
        "cp_top1": float((ref.cp.argmax(-1) == cand.cp.argmax(-1)).mean()) if cp_kl.size else 1.0,
        "cp_kl_per_head": cp_kl.mean(0).tolist() if cp_kl.size else [],
        "eos_drift": float(np.abs(ref.eos - cand.eos).mean()),
    }
