"""The speech service: what `POST /v1/audio/speech` and the WebSocket share, written once.

`prepare` turns a request body into the request the engine runs (parse and validate the
fields, the server's voice aliases and defaults, the model's own checks, the reference audio);
`stream` runs it (audio at the request's `sample_rate`: resampled here, in the server process,
by one `audio.Resampler` per request); `observe_chunk` / `observe_done` are its metrics, log
line and trace spans, and `observe_finish` (which `observe_done` calls) counts every utterance
once by why it ended, on every door.
The routes (`speech.py`, `speech_stream.py`) are adapters from HTTP or a socket to this, built
from the service, not from the whole server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from qwen3_tts_engine.audio import Resampler
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import AudioChunk, Result
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    FINISH_REASONS,
    SAMPLE_RATE,
    RequestError,
    SpeechRequest,
    parse_speech_request,
)
from qwen3_tts_engine.serving.metrics import Metrics
from qwen3_tts_engine.serving.ref_audio import resolve_ref_audio
from qwen3_tts_engine.serving.server_config import ServerConfig
from qwen3_tts_engine.serving.tracing import tracer


def decode_json(data: str | bytes, what: str) -> object:
    """A request body or a socket message as JSON; RequestError when it is not JSON, or nested
    too deeply or holds a number too long for Python's parser (both paths read JSON so)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise RequestError(f"{what} is not valid JSON (or is nested too deeply)") from None


def voice_aliases(engine: Engine, config: ServerConfig) -> dict[str, str]:
    """The configured voice aliases whose voice the loaded model has."""
    voices = set(engine.active.info.get("voices", []))
    return {a.lower(): v for a, v in config.voice_aliases.items() if v.lower() in voices}


def capped(result: Result) -> bool:
    """Whether the utterance (or one of its sentences) ran to its frame cap, `max_new_tokens` or
    the default (`protocol.default_max_new_tokens`), instead of ending by end-of-speech."""
    return bool((result.stats or {}).get("hit_token_cap"))


def finish_reason(result: Result) -> str:
    """Why a synthesis that ran to its end ended (`protocol.FINISH_REASONS`): the worker's own
    word where it gives one (its done stats' `finish_reason`), else `length` for a capped one and
    `stop` for one that ended by end-of-speech. A cancelled or failed one is the caller's to name
    (`abort`, `error`)."""
    stats = result.stats or {}
    reason = stats.get("finish_reason")
    if isinstance(reason, str) and reason in FINISH_REASONS:
        return reason
    return "length" if capped(result) else "stop"


async def _resampled(chunks: AsyncIterator[AudioChunk],
                     resampler: Resampler) -> AsyncIterator[AudioChunk]:  # fmt: skip
    """`chunks` with their PCM through one resampler (its state carried from chunk to chunk:
    no clicks at the seams); closing this closes `chunks` (the synthesis is cancelled)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield dataclasses.replace(chunk, pcm=resampler.process(chunk.pcm))


class SpeechService:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    def prepare(self, body: object, *, streamed: bool) -> tuple[SpeechRequest, bytes | None]:
        """The request and its reference audio's bytes from a decoded JSON body; RequestError
        (with the field) for anything wrong. `streamed`: a WebSocket session's `session.start`
        (its text comes later; `protocol.parse_speech_request`)."""
        req = parse_speech_request(body, self.config.limits, text_stream=streamed)
        req.voice = self.voice(req.voice)
        req.text_start_tokens = req.text_start_tokens or self.config.text_start_tokens
        req.text_pace = req.text_pace or self.config.text_pace
        self.engine.validate(req)
        ref = resolve_ref_audio(
            req.ref_audio, self.config.ref_audio_dir, self.config.limits.max_ref_audio_bytes
        )
        req.ref_audio = None  # the worker gets the bytes, not the encoded string
        return req, ref

    def voice(self, voice: str | None) -> str | None:
        """A model voice as asked, or the voice an alias names (unknown names stay for the
        model check to refuse, with the list of voices)."""
        if voice is None or voice.lower() in self.engine.active.info.get("voices", []):
            return voice
        return voice_aliases(self.engine, self.config).get(voice.lower(), voice)

    def stream(self, req: SpeechRequest, ref_audio: bytes | None, result: Result,
               text: TextInput | None = None) -> AsyncIterator[AudioChunk]:  # fmt: skip
        """The audio of `req`, chunk by chunk, at `req.sample_rate` (errors surface on
        iteration; the handler, and so the variant, is chosen when the synthesis starts, which
        may be after a swap)."""
        chunks = self.engine.stream(req, ref_audio=ref_audio, result=result, text=text)
        if req.sample_rate == SAMPLE_RATE:
            return chunks
        return _resampled(chunks, Resampler(SAMPLE_RATE, req.sample_rate))

    def served_by(self, result: Result) -> str:
        return str(result.variant or self.engine.active.variant)

    def observe_chunk(self, chunk: AudioChunk, result: Result) -> None:
        variant = str(result.variant)
        if chunk.index == 0:
            self.metrics.first_audio.labels(variant).observe(result.first_audio_s or 0.0)
            self.metrics.queue_wait.labels(variant).observe(result.queue_wait_s)
        self.metrics.chunk_compute.labels(variant).observe(chunk.compute_s)

    def observe_finish(self, reason: str, rid: str = "", span: trace.Span | None = None) -> str:
        """Count an utterance that ended, once, by `reason` (`protocol.FINISH_REASONS`): in
        `qwen3_tts_utterances_finished_total{reason}` and as `qwen3_tts.finish_reason` on `span`
        (default: the current span). `observe_done` calls it for one that ran to its end; a door
        calls it itself with "abort" (cancelled, client gone) or "error" (its synthesis failed).
        Returns `reason`."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"not a finish reason: {reason!r}")
        self.metrics.finished.labels(reason).inc()
        if reason == "repetition":
            logger.warning("%s: the loop detector ended it (its codes repeated)", rid)
        span = span if span is not None else trace.get_current_span()
        if span.is_recording():
            span.set_attribute("qwen3_tts.finish_reason", reason)
        return reason

    def observe_abort(self, rid: str = "", span: trace.Span | None = None) -> str:
        """`observe_finish("abort")`: an utterance cancelled, or whose client went away."""
        return self.observe_finish("abort", rid, span)

    def observe_done(self, result: Result, rid: str, t0: float, n: int) -> str:
        """An utterance that ran to its end (its stream finished): its metrics, log line and
        spans, and its finish reason counted (`observe_finish`); returns that reason."""
        reason = self.observe_finish(finish_reason(result), rid)
        total = time.perf_counter() - t0
        logger.info("%s done (%s): variant %s, %d chunks, first audio %.3fs, total %.3fs", rid,
                    reason, result.variant, n, result.first_audio_s or -1, total)  # fmt: skip
        if capped(result):
            self.metrics.capped.labels(str(result.variant)).inc()
            logger.warning("%s ran to its frame cap (%d frames): no end-of-speech", rid,
                           int((result.stats or {}).get("frames", 0)))  # fmt: skip
        span = trace.get_current_span()
        if not span.is_recording():
            return reason
        stats = result.stats or {}
        span.set_attributes({"qwen3_tts.variant": str(result.variant), "qwen3_tts.chunks": n,
                             "qwen3_tts.frames": int(stats.get("frames", 0)),
                             "qwen3_tts.queue_wait_s": result.queue_wait_s,
                             "qwen3_tts.first_audio_s": result.first_audio_s or -1.0})  # fmt: skip
        # the handler's part, as children: waiting for the worker, then synthesizing
        end = time.time_ns()
        start = end - int(total * 1e9)
        queued = start + int(min(result.queue_wait_s, total) * 1e9)
        attrs = {"qwen3_tts.variant": str(result.variant)}
        tracer.start_span("qwen3_tts.queue", start_time=start, attributes=attrs).end(
            end_time=queued
        )
        tracer.start_span("qwen3_tts.synthesis", start_time=queued, attributes=attrs).end(
            end_time=end
        )
        return reason
