"""The talker's prompt for one piece of text, as mlx-audio builds it for Qwen3-TTS.

Returns the prompt's embeddings, the text still to be fed one position per frame ("trailing
text"), and the pad embedding fed once that runs out. mlx-audio builds the reference code's
non-streaming layout: the whole text sits in the prompt and the trailing text is one pad.
"""

from __future__ import annotations

import mlx.core as mx

from qwen3_tts_engine.protocol import SpeechRequest
from qwen3_tts_engine.rules import Voice


def build_prompt(
    model, text: str, req: SpeechRequest, voice: Voice, ref_audio: mx.array | None
) -> tuple[mx.array, mx.array, mx.array]:
    """(prompt embeddings [1, L, H], trailing text [1, T, H], pad embedding [1, 1, H]) for
    `text` spoken by `voice` (checked by `rules.check_request`); in-context cloning when the
    request brings reference audio and its transcript (Base models)."""
    if ref_audio is not None and req.ref_text and model.config.tts_model_type == "base":
        embeds, trailing, pad, _ref_codes = model._prepare_icl_generation_inputs(
            text=text, ref_audio=ref_audio, ref_text=req.ref_text, language=req.language
        )
        return embeds, trailing, pad
    return model._prepare_generation_inputs(
        text=text, language=req.language, speaker=voice.speaker, ref_audio=ref_audio,
        instruct=voice.instruct,
    )  # fmt: skip
