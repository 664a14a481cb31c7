"""The streaming speech protocol shared by the client plugin and the engine server.

`POST /v1/audio/speech` takes OpenAI's fields plus vLLM-Omni's Qwen3-TTS fields; this module
validates a request body into a `SpeechRequest` (pure, no I/O) and names the audio constants.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SAMPLE_RATE = 24000  # the model's own rate
# what a request's `sample_rate` may ask for (the server resamples: audio.Resampler)
SAMPLE_RATES = (8000, 16000, 24000, 48000)
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # one 80 ms codec frame at 24 kHz
CHUNK_FRAMES = 4  # a 4-token chunk: 320 ms, 7680 samples
# The talker's text layouts (QwenLM/Qwen3-TTS `non_streaming_mode`): "prompt" puts the whole
# text in the prompt (non-streaming), "dual" feeds one text token per frame (dual-track).
TEXT_MODES = ("prompt", "dual")
# Streamed text (dual-track), docs/engine-api.md "Streaming text input" says why these values:
# text tokens committed before the first frame (1: first audio as soon as a word is complete)
DEFAULT_TEXT_START_TOKENS = 1
MAX_TEXT_START_TOKENS = 64
# text tokens fed per frame at most: 1.0 is the reference code's dual-track (one per frame)
DEFAULT_TEXT_PACE = 1.0
MIN_TEXT_PACE = 0.5  # two frames per token: within default_max_new_tokens's cap
# the first chunk of a streamed-text utterance (unless the request asks): its text arrives as it
# is written, so first audio is all that waits; 2 frames = 160 ms of audio, half a vocoder call
STREAM_FIRST_CHUNK_FRAMES = 2
BYTES_PER_SAMPLE = 2  # s16le mono
# Syntheses one handler worker advances together (continuous batching; `serve --max-batch`).
DEFAULT_MAX_BATCH = 8
# what a talker may compute in besides its weights' own dtype (float32: mlx-cpu's fast matmuls)
COMPUTE_DTYPES = ("float32",)
# "auto": float32 on mlx's CPU backend (its bfloat16 matmuls run a plain loop per row, so a batch
# of streams costs almost as much as the streams one by one), the weights' own dtype on a GPU
AUTO_COMPUTE = "auto"
# `--compute-dtype` choices ("weights": the weights' own dtype, None to the loader)
COMPUTE_CHOICES = (AUTO_COMPUTE, "weights", *COMPUTE_DTYPES)


def check_compute_dtype(dtype: str | None) -> None:
    """ValueError unless `dtype` is None (the weights' own), "auto" or one of COMPUTE_DTYPES."""
    if dtype is not None and dtype != AUTO_COMPUTE and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)} or auto (or "
                         f"none: the weights' own), got {dtype!r}")  # fmt: skip


def compute_dtype_option(choice: str) -> str | None:
    """What a `--compute-dtype` choice asks the loader for ("weights": None)."""
    return None if choice == "weights" else choice


# Streamed text input: utterances one after another on a WebSocket (serving/speech_stream.py
# has the messages); the hosted Qwen3-TTS realtime protocol at the hosted service's path
# (serving/qwen_realtime.py), so that its clients change only the base URL.
SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
SPEECH_STREAM_SUBPROTOCOL = "qwen3-tts.speech.v1"
QWEN_REALTIME_PATH = "/api-ws/v1/realtime"

# Response headers the engine sets; the client reads them.
HEADER_VARIANT = "X-Qwen3-TTS-Variant"
HEADER_MODEL = "X-Qwen3-TTS-Model"
HEADER_SAMPLE_RATE = "X-Sample-Rate"
HEADER_REQUEST_ID = "X-Request-Id"
# "true" on a whole (not streamed) response whose utterance ran to its frame cap
HEADER_CAPPED = "X-Qwen3-TTS-Capped"
# Why an utterance ended, on every door (POST's header and SSE done event, each socket dialect's
# done event, traces, metrics): "stop" (end of speech), "length" (a frame cap), "repetition"
# (the loop detector), "abort" (cancelled, or its client went away), "error".
HEADER_FINISH_REASON = "X-Finish-Reason"
FINISH_REASONS = ("stop", "length", "repetition", "abort", "error")

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
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
# OpenAI's response formats (mp3 is its default) and their content types. All but WAV stream
# chunk by chunk (a WAV header states the data length before the data: a streamed request for
# WAV gets the whole file).
CONTENT_TYPES = {
    "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
    "wav": "audio/wav", "pcm": "audio/pcm",
}  # fmt: skip
RESPONSE_FORMATS = tuple(CONTENT_TYPES)
STREAMED_FORMATS = ("mp3", "opus", "aac", "flac", "pcm")
STREAM_FORMATS = ("audio", "sse")
# OpenAI's voice names -> Qwen3-TTS CustomVoice speakers (by voice character; English first), so
# that OpenAI clients work unchanged. `qwen3-tts serve --voice-alias NAME=SPEAKER` changes them.
OPENAI_VOICE_ALIASES = {
    "alloy": "vivian", "ash": "ryan", "ballad": "aiden", "coral": "serena", "echo": "aiden",
    "fable": "ryan", "nova": "vivian", "onyx": "uncle_fu", "sage": "serena", "shimmer": "sohee",
    "verse": "ryan", "marin": "vivian", "cedar": "aiden",
}  # fmt: skip  # OpenAI's stream_format: raw audio bytes, or server-sent events


# The error code of a 429 from an engine that cannot take a request in time (its batch is at its
# real-time slots and its queue at its bound): try another engine, or this one after Retry-After.
ENGINE_FULL = "engine_full"
MAX_ERROR_CHARS = (
    500  # an error message quotes what it refuses, cut to this (input may be megabytes)
)


class RequestError(ValueError):
    """A client error: becomes a 4xx answer with an OpenAI-style JSON body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:  # fmt: skip
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 1] + "…"
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code  # a name for the error ("engine_full"); the status when None

    def to_json(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code or self.status}}  # fmt: skip


def normalize_language(value: str | None) -> str:
    """Full lower-case language name for Qwen3-TTS ("en" -> "english"); "auto" when unset."""
    if value is None or value == "":
        return "auto"
    key = value.strip().lower().replace("_", "-")
    key = _LANGUAGE_ALIASES.get(key, key)
    if key not in LANGUAGES:
        raise RequestError(
            f"unknown language {value!r}; use one of {', '.join(LANGUAGES)} or a code such as 'en'",
            param="language",
        )
    return key


@dataclass
class Limits:
    max_input_chars: int = 4000
    max_new_tokens: int = 4096
    max_ref_audio_bytes: int = 8 * 1024 * 1024


@dataclass
class SpeechRequest:
    input: str
    model: str | None = None
    voice: str | None = None
    response_format: str = "mp3"
    stream: bool = False  # chunked audio as it is made (also set by stream_format); not for WAV
    stream_format: str | None = None  # "sse": OpenAI's speech.audio.delta/done events
    task_type: str | None = None  # custom_voice | voice_design | base
    language: str = "auto"
    instructions: str | None = None
    ref_audio: str | None = None  # base64 / data URI, or a file under the allow-listed directory
    ref_text: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    variant: str | None = None
    first_chunk_frames: int = CHUNK_FRAMES
    # the talker's text layout: "prompt" (non-streaming) | "dual" (dual-track); None: the
    # reference code's default for the model's task (`text_mode_for`)
    text_mode: str | None = None
    text_stream: bool = False  # the text comes in pieces (the WebSocket route), dual-track
    text_start_tokens: int | None = None  # streamed text: text tokens before the first frame
    text_pace: float | None = None  # dual-track: text tokens fed per frame at most (<= 1)
    sample_rate: int = SAMPLE_RATE  # of the audio sent (SAMPLE_RATES; the server resamples)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _opt(body: dict, key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass: never accept it where a number is meant.
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"{key} must be {what}", param=key)
    if not isinstance(value, kinds):
        raise RequestError(f"{key} must be {what}", param=key)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{key} must be a finite number", param=key)
    return value


def has_speakable_text(text: str) -> bool:
    """True when `text` holds a character that is not a control, format (zero-width, BOM),
    separator or space character: input of only those makes no speech, only noise."""
    return any(unicodedata.category(c)[0] not in "CZ" for c in text)


# What text may not hold: lone surrogates (U+D800-DFFF: not Unicode scalar values, though JSON's
# "\ud83d" escapes make them; the tokenizer cannot encode them) and the noncharacters (U+FDD0-FDEF
# and the last two code points of every plane, U+xFFFE and U+xFFFF).
_NOT_TEXT = re.compile("[\ud800-\udfff\ufdd0-\ufdef"
                       + "".join(f"{chr(p + 0xFFFE)}{chr(p + 0xFFFF)}" for p in range(0, 0x110000, 0x10000))
                       + "]")  # fmt: skip


def check_text(text: str, param: str) -> str:
    """`text` if it is made of Unicode scalar values that are characters, else RequestError naming
    `param`: a lone surrogate or a noncharacter is refused. The one check of every text that can
    reach the model (a request's text fields, each streamed piece), run in the server process."""
    if (bad := _NOT_TEXT.search(text)) is not None:
        code = ord(bad.group())
        what = "a lone surrogate" if 0xD800 <= code <= 0xDFFF else "a noncharacter"
        raise RequestError(f"{param} holds {what} (U+{code:04X} at character {bad.start()}); text "
                           "must be Unicode scalar values, without surrogates or noncharacters "
                           "(send a character above U+FFFF whole, not half of its UTF-16 pair)",
                           param=param)  # fmt: skip
    return text


def _text(body: dict, key: str, max_len: int) -> str | None:
    value = _opt(body, key, (str,), "a string")
    if value is not None and len(value) > max_len:
        raise RequestError(f"{key} is longer than {max_len} characters", param=key)
    return value if value is None else check_text(value, key)


def _in_range(key: str, value: float | int | None, lo: float, hi: float) -> None:
    if value is not None and not (lo <= value <= hi):
        raise RequestError(f"{key} must be between {lo} and {hi}", param=key)


def check_input(text: str | None, limits: Limits | None = None) -> str:
    """The text to speak, checked as the server checks it (the command line uses it too)."""
    limits = limits or Limits()
    if text is None or not text.strip():
        raise RequestError("input must be a non-empty string", param="input")
    check_text(text, "input")
    if not has_speakable_text(text):
        raise RequestError("input has no speakable text (only control or zero-width characters)",
                           param="input")  # fmt: skip
    check_length(len(text), limits)
    return text


def check_length(chars: int, limits: Limits) -> None:
    """The length rule of a request's text (POST's `input`, a session's pieces together)."""
    if chars > limits.max_input_chars:
        raise RequestError(f"input is longer than {limits.max_input_chars} characters; split it",
                           param="input")  # fmt: skip


def _sample_rate(body: dict) -> int:
    rate = _opt(body, "sample_rate", (int,), "an integer (Hz)")
    if rate is None:
        return SAMPLE_RATE
    if rate not in SAMPLE_RATES:
        raise RequestError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))} (Hz), "
                           f"not {rate}", param="sample_rate")  # fmt: skip
    return rate


def parse_speech_request(body: Any, limits: Limits | None = None, *,
                         text_stream: bool = False) -> SpeechRequest:  # fmt: skip
    """Validate a decoded JSON body. Raises RequestError with the offending field.

    `text_stream`: the body starts a streamed-text session (the WebSocket route's
    `session.start`): its text comes later (an `input`, if any, is the first piece), its audio
    is PCM and its layout dual-track."""
    limits = limits or Limits()
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")

    if text_stream:
        text = check_text(_opt(body, "input", (str,), "a string") or "", "input")
        check_length(len(text), limits)
    else:
        text = check_input(_opt(body, "input", (str,), "a string"), limits)

    fmt = _opt(body, "response_format", (str,), "a string") or ("pcm" if text_stream else "mp3")
    if text_stream and fmt != "pcm":
        raise RequestError("streamed text is answered in pcm (s16le mono at sample_rate); "
                           "response_format must be pcm", param="response_format")  # fmt: skip
    if fmt not in RESPONSE_FORMATS:
        raise RequestError(
            f"response_format {fmt!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
            param="response_format",
        )
    stream = _opt(body, "stream", (bool,), "true or false") or False
    stream_format = _opt(body, "stream_format", (str,), "a string")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise RequestError(f"stream_format must be one of {', '.join(STREAM_FORMATS)}",
                           param="stream_format")  # fmt: skip
    stream = stream or stream_format is not None
    if stream_format == "sse" and fmt not in STREAMED_FORMATS:
        raise RequestError(f"{fmt} cannot be streamed as events (its header states the length "
                           f"first); use one of {', '.join(STREAMED_FORMATS)}",
                           param="response_format")  # fmt: skip

    task = _opt(body, "task_type", (str,), "a string")
    if task is not None:
        if task not in TASK_TYPES and task not in TASK_TYPES.values():
            raise RequestError(
                f"task_type must be one of {', '.join(TASK_TYPES)}", param="task_type"
            )
        task = TASK_TYPES.get(task, task)

    speed = _opt(body, "speed", (int, float), "a number")
    if speed is not None and speed != 1.0:
        raise RequestError("speed other than 1.0 is not supported by Qwen3-TTS", param="speed")

    max_new = _opt(body, "max_new_tokens", (int,), "an integer")
    _in_range("max_new_tokens", max_new, 1, limits.max_new_tokens)
    temperature = _opt(body, "temperature", (int, float), "a number")
    _in_range("temperature", temperature, 0.0, 2.0)
    top_k = _opt(body, "top_k", (int,), "an integer")
    _in_range("top_k", top_k, 0, 4096)
    top_p = _opt(body, "top_p", (int, float), "a number")
    _in_range("top_p", top_p, 0.0, 1.0)
    rep = _opt(body, "repetition_penalty", (int, float), "a number")
    _in_range("repetition_penalty", rep, 1.0, 3.0)
    seed = _opt(body, "seed", (int,), "an integer")
    _in_range("seed", seed, 0, 2**32 - 1)
    first = _opt(body, "first_chunk_frames", (int,), "an integer")
    if first is not None and first not in (1, 2, CHUNK_FRAMES):
        raise RequestError("first_chunk_frames must be 1, 2 or 4", param="first_chunk_frames")

    text_mode = _opt(body, "text_mode", (str,), "a string")
    if text_mode is not None and text_mode not in TEXT_MODES:
        raise RequestError(f"text_mode must be one of {', '.join(TEXT_MODES)}", param="text_mode")
    start_tokens = _opt(body, "text_start_tokens", (int,), "an integer")
    _in_range("text_start_tokens", start_tokens, 1, MAX_TEXT_START_TOKENS)
    pace = _opt(body, "text_pace", (int, float), "a number")
    _in_range("text_pace", pace, MIN_TEXT_PACE, 1.0)

    ref_audio = _opt(body, "ref_audio", (str,), "a string")
    if ref_audio is not None and len(ref_audio) > limits.max_ref_audio_bytes * 4 // 3 + 64:
        raise RequestError("ref_audio is too large", param="ref_audio", status=413)

    return SpeechRequest(
        input=text,
        text_stream=text_stream,
        model=_text(body, "model", 256),
        voice=_text(body, "voice", 64),
        response_format=fmt,
        stream=stream,
        stream_format=stream_format if stream_format == "sse" else None,
        task_type=task,
        language=normalize_language(_opt(body, "language", (str,), "a string")),
        instructions=_text(body, "instructions", 1000),
        ref_audio=ref_audio,
        ref_text=_text(body, "ref_text", limits.max_input_chars),
        max_new_tokens=max_new,
        temperature=None if temperature is None else float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
        repetition_penalty=None if rep is None else float(rep),
        seed=seed,
        variant=_text(body, "variant", 64),
        first_chunk_frames=first or (STREAM_FIRST_CHUNK_FRAMES if text_stream else CHUNK_FRAMES),
        text_mode=text_mode,
        text_start_tokens=start_tokens,
        text_pace=None if pace is None else float(pace),
        sample_rate=_sample_rate(body),
    )


# The default frame cap (docs/engine-api.md "The frame cap"): the text at the slowest speaking
# rate, so that an utterance that never emits end-of-speech still ends, and slow speech is not cut.
SLOWEST_CHARS_PER_S = 5.0  # slow, deliberate speech, in characters (Latin, Cyrillic...) a second
CAP_SLACK_FRAMES = 40  # 3.2 s more (a breath, a pause): the cap of an empty text, its floor
SLOW_SPEECH_FACTOR = 2  # instructions that ask for slow or emotional speech double the time
# One CJK character (Han, kana, Hangul syllable) is a syllable: it counts as 2 characters (2.5
# syllables a second at the slowest).
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
# Words (prefixes, at a word's start) of instructions that ask for slow or emotional speech, and
# their Chinese counterparts (anywhere).
_SLOW_WORDS = re.compile(
    r"\b(?:slow|whisper|sad|emotion|cry|cries|sob|tear|dramatic|hesita|paus|sleep|tired|"
    r"melanchol|grie|mourn|drawl|calm|gentl|soft)|慢|哭|悲|伤心|哽咽|抽泣|低语|耳语|轻声",
    re.IGNORECASE,
)


def speech_chars(text: str) -> int:
    """The characters the frame cap counts: each CJK character counts twice."""
    return len(text) + len(_CJK.findall(text))


def slow_speech(instructions: str | None) -> bool:
    """Whether `instructions` ask for slow or emotional speech (`_SLOW_WORDS`)."""
    return bool(instructions) and _SLOW_WORDS.search(instructions) is not None


def default_max_new_tokens(text: str | int, instructions: str | None = None) -> int:
    """The frame cap of a text (or of its `speech_chars` count) when the request sets no
    `max_new_tokens`, so that a generation that never emits end-of-speech ends:

        ceil(speech_chars * FRAME_RATE * factor / SLOWEST_CHARS_PER_S) + CAP_SLACK_FRAMES

    i.e. 2.5 frames per character + 40, `factor` 2 (5 frames per character) when the
    instructions ask for slow or emotional speech (`slow_speech`), never above
    `Limits.max_new_tokens`.
    """
    chars = text if isinstance(text, int) else speech_chars(text)
    factor = SLOW_SPEECH_FACTOR if slow_speech(instructions) else 1
    frames = math.ceil(chars * FRAME_RATE * factor / SLOWEST_CHARS_PER_S) + CAP_SLACK_FRAMES
    return min(Limits.max_new_tokens, frames)


# -- response bodies of the operator endpoints (typed; `to_json` is what goes on the wire) ------


def _from(cls, data: Any):
    """A dataclass from a JSON object, ignoring unknown keys (newer servers may add fields)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


LOAD_STATES = ("serving", "swapping", "draining", "loading")


@dataclass
class LoadReport:
    """`GET /load`, and `capacity` in `GET /v1/engine/status`: how much more this engine takes
    (docs/fleet.md). Cheap: the server answers from what it holds, without asking a worker."""

    running: int  # streams admitted and not finished (every handler), less the `held` ones
    waiting: int  # requests queued, not yet admitted
    max_batch: int  # configured batch rows of the serving handler
    slots: (
        int  # streams kept in real time now (measured step time vs the frame budget), 1..max_batch
    )
    free_slots: int  # max(0, slots - running - waiting); 0 unless serving
    accepting: bool  # takes new requests (serving, or holding them through a swap)
    state: str  # LOAD_STATES
    underruns: int  # chunks made after their listener needed them (a counter)
    frame_budget_ms: float | None = None  # None: no budget (slots = max_batch)
    # predicted seconds of a batch step by streams in it ("1".."max_batch"), from measured steps
    step_s: dict[str, float] = field(default_factory=dict)
    sessions: int = 0  # WebSocket sessions open (each is one of `running` once its text comes)
    # sessions holding no stream and no slot: their utterance's text has not begun, or they are
    # between utterances (a warm socket)
    sessions_waiting_for_text: int = 0
    # running + waiting: the number vLLM's own `/load` answers as `server_load` (routers read it)
    server_load: int = 0
    # The memory governor's reading (None without one): the used fraction of its memory limit,
    # and where it lies in the policy's band (0 at or below `upgrade_at`, 1 at `critical_at`).
    memory_pressure: float | None = None
    memory_load: float = 0.0
    # Memory in admission (models/stream_memory.py): the bytes the running streams hold at their
    # largest, the bytes the serving worker's streams may hold (None: no memory rule), and
    # whether the first queued request waits for memory (its slot is free: it starts when a
    # stream ends).
    stream_memory_bytes: int = 0
    stream_memory_budget_bytes: int | None = None
    waiting_for_memory: bool = False
    # Streams admitted that lent their slot (not in `running`, `server_load` or the free-slot
    # count): nothing to compute until their client reads or their streamed text comes
    held: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> LoadReport:
        return _from(cls, data)


@dataclass
class ReadyStatus:
    """`GET /ready` (200 when ready, else 503)."""

    ready: bool
    variant: str | None
    state: str
    queue_depth: int
    swapping: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelCard:
    """One entry of `GET /v1/models`."""

    id: str
    tts_model_type: str | None
    voices: list[str]
    languages: list[str]
    variants: list[str]
    active_variant: str | None
    voice_aliases: dict[str, str] = field(default_factory=dict)  # usable aliases -> voices
    sample_rate: int = SAMPLE_RATE
    object: str = "model"
    owned_by: str = "qwen3-tts"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HandlerStatus:
    """One handler (one worker process, one variant) in `GET /v1/engine/status`."""

    name: str
    variant: str | None
    state: str  # starting | ready | draining | failed | stopped
    pid: int | None
    active: bool
    retiring: bool
    queue_depth: int  # waiting + in flight
    waiting: int
    restarts: int
    last_stats: dict | None
    memory: dict
    info: dict
    quantized_modules: int
    # The worker's process memory by part: weights (talker, speech tokenizer, speaker encoder),
    # runtime (the rest of the process) and the KV bytes a stream adds per frame.
    footprint: dict = field(default_factory=dict)
    # Continuous batching in the worker: active_streams, max_batch, step_s_p50/p95 (one talker
    # step for all streams), batch_occupancy (mean rows per step / max_batch), kv_bytes(_per_stream).
    batching: dict = field(default_factory=dict)


@dataclass
class EngineStatus:
    """`GET /v1/engine/status`: the handlers, and the governor's state when one runs (its
    `policy` then holds the thresholds: `upgrade_at`, `critical_at`, ...)."""

    model: str
    active_variant: str | None
    serving: bool
    waiting_for_swap: int
    handlers: list[HandlerStatus]
    governor: dict | None = None
    capacity: dict | None = None  # LoadReport's fields (`GET /load`)
    # text streamed in while it is spoken (the WebSocket route): clients detect support here
    streaming_text: bool = False
    streaming_text_route: str | None = None

    @property
    def queue_depth(self) -> int:
        return sum(h.queue_depth for h in self.handlers)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> EngineStatus:
        status = _from(cls, data)
        status.handlers = [_from(HandlerStatus, h) for h in status.handlers or []]
        return status


@dataclass
class VariantChange:
    """`POST /v1/engine/variant`'s answer: what serves now, the pin, the swap record if any."""

    active_variant: str | None
    pinned: str | None
    swap: dict | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> VariantChange:
        return _from(cls, data)
