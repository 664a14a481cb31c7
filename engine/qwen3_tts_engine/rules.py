"""The rule book of a speech request against a loaded model: one set of checks, in one place.

The server runs them before a request waits for anything (`dispatch/engine.py`: a request no
handler can serve is refused with a 4xx at once) and the worker runs them again when a stream
starts (`worker/scheduler.py`: the model it checks against is the one that will speak). Both
check against `ModelInfo`, the description a worker reports of the model it loaded. The shape
checks of a request (types, ranges, lengths) are `protocol.parse_speech_request`'s; this module
knows what a model of each kind can do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qwen3_tts_engine.protocol import RequestError, SpeechRequest

# The reference code's default layout per task for a whole text (QwenLM/Qwen3-TTS
# qwen3_tts_model.py: `generate_custom_voice` and `generate_voice_design` default to
# non_streaming_mode=True since its commit 0c6a7cb, `generate_voice_clone` to False).
DEFAULT_TEXT_MODES = {"custom_voice": "prompt", "voice_design": "prompt", "base": "dual"}

MODEL_KINDS = ("custom_voice", "voice_design", "base")


@dataclass(frozen=True)
class ModelInfo:
    """What a request is checked against: the loaded model's kind, voices and languages."""

    kind: str  # config.json's tts_model_type: custom_voice | voice_design | base
    size: str | None = None  # tts_model_size: "0b6" | "1b7"
    voices: tuple[str, ...] = ()  # preset speakers, lower case
    languages: tuple[str, ...] = ("auto",)  # "auto" and the language names the codec knows
    can_clone: bool = False  # the speech tokenizer has the encoder in-context cloning needs

    @classmethod
    def from_info(cls, info: Mapping) -> ModelInfo:
        """From a worker's info (`worker/loading.py: describe`, as `/v1/engine/status` shows it)."""
        return cls(
            kind=info["tts_model_type"],
            size=info.get("tts_model_size"),
            voices=tuple(v.lower() for v in info.get("voices", ())),
            languages=tuple(info.get("languages", ("auto",))),
            can_clone=bool(info.get("can_clone", False)),
        )


@dataclass(frozen=True)
class Voice:
    """Who speaks, as the model takes it: a preset speaker (lower case) and an instruction."""

    speaker: str | None
    instruct: str | None


def check_request(req: SpeechRequest, model: ModelInfo, *, ref_audio: bool | None = None) -> Voice:
    """The voice `model` will speak `req` with, or RequestError naming what it cannot do.

    `ref_audio`: whether reference audio comes with the request (None: `req.ref_audio` says; the
    worker gets the audio's bytes apart from the request)."""
    has_ref = bool(req.ref_audio) if ref_audio is None else ref_audio
    kind = model.kind
    if req.task_type is not None and req.task_type != kind:
        raise RequestError(f"task_type {req.task_type!r} does not match this model ({kind})",
                           param="task_type")  # fmt: skip
    voice = req.voice.lower() if req.voice else None
    instruct = req.instructions or None
    if kind == "custom_voice":
        if voice is None and model.voices:
            voice = sorted(model.voices)[0]
        if voice not in model.voices:
            raise RequestError(f"unknown voice {req.voice!r}; voices: {', '.join(sorted(model.voices))}",
                               param="voice")  # fmt: skip
        if model.size == "0b6":
            instruct = None  # the 0.6B CustomVoice models were not trained with instructions
    elif kind == "voice_design":
        if not instruct:
            raise RequestError("a VoiceDesign model needs `instructions` describing the voice",
                               param="instructions")  # fmt: skip
        voice = None
    elif voice is not None and voice not in model.voices:  # base
        raise RequestError(f"voice {req.voice!r}: Base models have no preset voices; send ref_audio "
                           "(and ref_text for in-context cloning) instead", param="voice")  # fmt: skip
    if req.language not in model.languages:
        raise RequestError(f"language {req.language!r} is not supported by this model; "
                           f"languages: {', '.join(model.languages)}", param="language")  # fmt: skip
    if req.ref_text and not has_ref:
        raise RequestError("ref_text needs ref_audio", param="ref_text")
    if has_ref and kind != "base":
        raise RequestError("ref_audio needs a Base model", param="ref_audio")
    if has_ref and req.ref_text and not model.can_clone:
        raise RequestError("this checkpoint has no speech-tokenizer encoder: it cannot clone from "
                           "ref_audio with ref_text", param="ref_text")  # fmt: skip
    text_mode_for(req, model)
    return Voice(voice, instruct)


def text_mode_for(req: SpeechRequest, model: ModelInfo) -> str:
    """The layout `req` is spoken in (`protocol.TEXT_MODES`): streamed text needs dual-track;
    a whole text takes what it asks or the reference code's default for the model's task."""
    if not req.text_stream:
        return req.text_mode or DEFAULT_TEXT_MODES.get(model.kind, "prompt")
    if req.text_mode == "prompt":
        raise RequestError("streamed text is spoken dual-track (one text token per frame); "
                           "text_mode 'prompt' needs the whole text: send it to "
                           "POST /v1/audio/speech", param="text_mode")  # fmt: skip
    if req.ref_text:
        raise RequestError("in-context voice cloning (ref_audio with ref_text) cannot stream "
                           "text: its prompt holds the whole text beside the reference; send "
                           "ref_audio alone (x-vector cloning) or the whole text to "
                           "POST /v1/audio/speech", param="ref_text")  # fmt: skip
    return "dual"
