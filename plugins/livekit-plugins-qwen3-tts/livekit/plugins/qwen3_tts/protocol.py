"""The client's half of the engine's streaming speech protocol (qwen3-tts-engine's
`qwen3_tts_engine/protocol.py` is the server's half; tests/plugins/qwen3_tts/test_wire_contract.py keeps the two
in step, without this plugin importing the engine).

`POST /v1/audio/speech` takes OpenAI's fields plus vLLM-Omni's Qwen3-TTS fields and streams
s16le mono PCM at 24 kHz, one HTTP chunk per 4-frame audio chunk; errors are OpenAI-style JSON
bodies (`{"error": {"message", "type", "param", "code"}}`).

`GET /v1/audio/speech/stream` (WebSocket, subprotocol `qwen3-tts.speech.v1`) takes a reply's text
as it is written: one socket per utterance; JSON control messages, binary PCM frames back. An
engine that has it says `"streaming_text": true` in `GET /v1/engine/status`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

ENGINE_FULL = "engine_full"  # the error code of a 429: batch and queue are full, try another engine

SAMPLE_RATE = 24000  # the model's own rate
# what a request's `sample_rate` may ask for (the engine resamples; `TTS(sample_rate=...)`)
SAMPLE_RATES = (8000, 16000, 24000, 48000)
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # one 80 ms codec frame at 24 kHz
CHUNK_FRAMES = 4  # a 4-token chunk: 320 ms, 7680 samples
BYTES_PER_SAMPLE = 2  # s16le mono

# Response headers the engine sets; the client reads them.
HEADER_VARIANT = "X-Qwen3-TTS-Variant"
HEADER_MODEL = "X-Qwen3-TTS-Model"
HEADER_SAMPLE_RATE = "X-Sample-Rate"
HEADER_REQUEST_ID = "X-Request-Id"
HEADER_CAPPED = "X-Qwen3-TTS-Capped"  # "true" on a whole response that ran to its frame cap
# Why an utterance ended (the engine's word on every door: POST's header, each socket dialect's
# done event): "stop" (end of speech), "length" (a frame cap), "repetition" (its loop
# detector), "abort" (cancelled, client gone), "error".
HEADER_FINISH_REASON = "X-Finish-Reason"
FINISH_REASONS = ("stop", "length", "repetition", "abort", "error")

# Streaming text input over a WebSocket.
STATUS_PATH = "/v1/engine/status"
SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
SPEECH_STREAM_SUBPROTOCOL = "qwen3-tts.speech.v1"
# Client -> server message types
MSG_SESSION_START = "session.start"
MSG_TEXT_APPEND = "input_text.append"
MSG_TEXT_END = "input_text.end"
MSG_CANCEL = "response.cancel"
# Server -> client event types
EV_SESSION_CREATED = "session.created"
EV_TEXT_ACK = "input_text.ack"
EV_FIRST_AUDIO = "response.first_audio"
EV_DONE = "response.done"
EV_ERROR = "error"
# vLLM-Omni's dialect at the same route (an upgrade without the subprotocol: `socket_dialects.py`)
OMNI_CONFIG = "session.config"
OMNI_INPUT_TEXT = "input.text"
OMNI_INPUT_DONE = "input.done"  # a flush: the utterance ends, the socket stays open
OMNI_SESSION_CLOSE = "session.close"
OMNI_AUDIO_START = "audio.start"
OMNI_AUDIO_DONE = "audio.done"
OMNI_SESSION_DONE = "session.done"

LANGUAGES = (
    "auto", "chinese", "english", "japanese", "korean", "german",
    "french", "russian", "portuguese", "spanish", "italian",
)  # fmt: skip
_LANGUAGE_ALIASES = {
    "en": "english", "en-us": "english", "en-gb": "english", "eng": "english",
    "zh": "chinese", "zh-cn": "chinese", "cmn": "chinese", "mandarin": "chinese",
    "ja": "japanese", "jp": "japanese", "ko": "korean", "de": "german", "fr": "french",
    "ru": "russian", "pt": "portuguese", "pt-br": "portuguese", "es": "spanish",
    "it": "italian",
}  # fmt: skip


def has_speakable_text(text: str) -> bool:
    """The engine's rule for `input` (qwen3_tts_engine.protocol.has_speakable_text): a character
    that is not a control, format (zero-width, BOM), separator or space character. Text of only
    those is refused with 400; the plugin sends none (an LLM may end a reply with a zero-width
    character)."""
    return any(unicodedata.category(c)[0] not in "CZ" for c in text)


def rate_mismatch(asked: int, said: Any) -> str | None:
    """Why audio the engine says is at `said` Hz (its `X-Sample-Rate`, its `session.created`)
    cannot be played as `asked` (None: it can, or it said nothing). An engine older than the
    `sample_rate` field speaks 24 kHz whatever was asked: played at 16 kHz it would be slow and
    low, so the request fails instead."""
    try:
        rate = int(said)
    except (TypeError, ValueError):
        return None
    if rate == asked:
        return None
    return (
        f"the engine answered at {rate} Hz where {asked} Hz was asked: it does not take "
        "`sample_rate` (an older engine?); run the engine and the plugin from one release"
    )


def normalize_language(value: str | None) -> str:
    """Full lower-case language name for Qwen3-TTS ("en" -> "english"); "auto" when unset."""
    if value is None or value == "":
        return "auto"
    key = value.strip().lower().replace("_", "-")
    key = _LANGUAGE_ALIASES.get(key, key)
    if key not in LANGUAGES:
        raise ValueError(
            f"unknown language {value!r}; use one of {', '.join(LANGUAGES)} or a code such as 'en'"
        )
    return key


def error_message(body: Any) -> str | None:
    """The message of an engine (or OpenAI-style) error body, if it is one."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        message = body["error"].get("message")
        return str(message) if message is not None else None
    return None


def streams_text(status: Any) -> bool:
    """Whether a `GET /v1/engine/status` body announces the streaming-text WebSocket."""
    return isinstance(status, Mapping) and status.get("streaming_text") is True


def stream_error(event: Mapping) -> tuple[int, str]:
    """(HTTP status, message) of the socket's `error` event: the status the same error gets on
    `POST /v1/audio/speech` (500 if the event has none), and its OpenAI-style message."""
    try:
        status = int(event.get("status") or 500)
    except (TypeError, ValueError):
        status = 500
    message = error_message(event) or event.get("message")  # vLLM-Omni's: {"type", "message"}
    return status, str(message) if message else f"engine error {status}"


def finish_reason(said: Any, *, capped: bool = False) -> str:
    """Why an utterance ended: the engine's own word (a done event's `finish_reason`, POST's
    `X-Finish-Reason`) where it gave one; an engine older than that word ended it by its frame
    cap ("length", its `capped` flag or a cap the client saw reached) or else by end of speech
    ("stop"). A word outside `FINISH_REASONS` (a newer engine's) is kept as said."""
    if isinstance(said, str) and said.strip():
        return said.strip().lower()
    return "length" if capped else "stop"


def retry_after_s(value: str | None, default: float = 1.0) -> float:
    """`Retry-After` in seconds (the engine sends whole seconds; an HTTP date counts as the
    default), kept within 0..60."""
    try:
        seconds = float(value) if value is not None else default
    except ValueError:
        seconds = default
    return min(60.0, max(0.0, seconds))
