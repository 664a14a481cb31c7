"""`POST /v1/audio/speech`: OpenAI's speech request (plus vLLM-Omni's Qwen3-TTS fields), audio
streamed as it is made: raw PCM chunks (or another format) in one chunked HTTP response, or
OpenAI's `speech.audio.delta` server-sent events. The route parses and delegates to the engine
(`dispatch/engine.py`); errors are `errors.py`'s OpenAI-style bodies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from qwen3_tts_engine.audio import AudioEncoder, encode_whole
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Result
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    CONTENT_TYPES,
    HEADER_MODEL,
    HEADER_REQUEST_ID,
    HEADER_SAMPLE_RATE,
    HEADER_VARIANT,
    SAMPLE_RATE,
    STREAMED_FORMATS,
    RequestError,
    SpeechRequest,
    parse_speech_request,
)
from qwen3_tts_engine.serving.errors import MAPPED, as_request_error, error_response
from qwen3_tts_engine.serving.ref_audio import resolve_ref_audio
from qwen3_tts_engine.serving.tracing import extract_context, tracer

if TYPE_CHECKING:
    from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

_request_ids = itertools.count(1)


def sse_event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def speech_usage(req: SpeechRequest, result: Result) -> dict:
    """OpenAI's usage object for a speech: output tokens are the codec frames made (the model's
    audio tokens); input tokens count the input's characters (the server does not tokenize)."""
    frames = int((result.stats or {}).get("frames", 0))
    chars = len(req.input)
    return {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames}


def voice_aliases(engine: Engine, config: ServerConfig) -> dict[str, str]:
    """The configured voice aliases whose voice the loaded model has."""
    voices = set(engine.active.info.get("voices", []))
    return {a.lower(): v for a, v in config.voice_aliases.items() if v.lower() in voices}


class SpeechRoutes:
    """The speech path of an `EngineServer`."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/audio/speech", self.speech)]

    async def speech(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(HEADER_REQUEST_ID) or f"tts-{next(_request_ids)}"
        t0 = time.perf_counter()
        # a child of the caller's span when the request carries `traceparent`
        with tracer.start_as_current_span("qwen3_tts.speech", context=extract_context(request.headers),
                                          kind=SpanKind.SERVER,
                                          attributes={"qwen3_tts.request_id": rid}) as span:  # fmt: skip
            try:
                response = await self._speech(request, rid, t0)
            except RequestError as e:
                self.server.metrics.requests.labels(str(e.status)).inc()
                logger.info("%s rejected (%d): %s", rid, e.status, e.message)
                span.set_attribute("http.response.status_code", e.status)
                span.set_status(StatusCode.ERROR, e.message)
                return error_response(e, retry_after_s=self.server.config.retry_after_s)
            self.server.metrics.requests.labels(str(response.status)).inc()
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _speech(self, request: web.Request, rid: str, t0: float) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError("request body is too large", status=413) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("request body is not valid JSON") from None
        req = parse_speech_request(body, self.server.config.limits)
        req.voice = self._voice(req.voice)
        req.text_pace = req.text_pace or self.server.config.text_pace
        self.server.engine.validate(req)
        ref = resolve_ref_audio(req.ref_audio, self.server.config.ref_audio_dir,
                                self.server.config.limits.max_ref_audio_bytes)  # fmt: skip
        req.ref_audio = None  # the worker gets the bytes, not the encoded string
        result = Result()
        # Errors surface on iteration; the handler (and so the variant) is chosen when the
        # synthesis starts, which may be after a variant swap.
        chunks = self.server.engine.stream(req, ref_audio=ref, result=result)
        headers = {HEADER_MODEL: self.server.engine.model, HEADER_SAMPLE_RATE: str(SAMPLE_RATE),
                   HEADER_REQUEST_ID: rid}  # fmt: skip
        if req.stream and req.response_format in STREAMED_FORMATS:
            return await self._stream(request, req, chunks, result, headers, rid, t0)
        return await self._whole(chunks, req, result, headers, rid, t0)

    async def _stream(self, request, req: SpeechRequest, chunks, result: Result, headers, rid, t0):
        """Each audio chunk goes out as it is made: encoded in the response format, as raw bytes
        or (stream_format "sse") as OpenAI's speech.audio.delta events, then speech.audio.done."""
        sse = req.stream_format == "sse"
        content_type = "text/event-stream" if sse else CONTENT_TYPES[req.response_format]
        response = web.StreamResponse(status=200, headers={**headers, "Content-Type": content_type})
        if sse:
            response.headers["Cache-Control"] = "no-cache"
        response.enable_chunked_encoding()
        encoder = AudioEncoder(req.response_format)

        async def send(data: bytes) -> None:
            if data:
                await response.write(sse_event({"type": "speech.audio.delta",
                                                "audio": base64.b64encode(data).decode()})
                                     if sse else data)  # fmt: skip

        n = 0
        try:
            async with contextlib.aclosing(chunks):
                try:
                    async for chunk in chunks:
                        if n == 0:
                            response.headers[HEADER_VARIANT] = self._served_by(result)
                            await response.prepare(request)
                        await send(encoder.encode(chunk.pcm))
                        self._observe_chunk(chunk, result)
                        n += 1
                except MAPPED as e:
                    if n == 0:  # nothing sent yet: a proper error status is still possible
                        raise as_request_error(e) from None
                    # Audio already went out: abort the connection so the client sees an error.
                    logger.error("%s failed after %d chunks: %s", rid, n, e)
                    self.server.metrics.requests.labels("aborted").inc()
                    if request.transport is not None:
                        request.transport.close()
                    return response
                except (ConnectionResetError, asyncio.CancelledError):
                    logger.info("%s: client went away after %d chunks; synthesis cancelled", rid, n)
                    raise
            if n == 0:
                response.headers[HEADER_VARIANT] = self._served_by(result)
                await response.prepare(request)
            await send(encoder.finish())
        finally:
            encoder.close()
        if sse:
            await response.write(sse_event({"type": "speech.audio.done",
                                            "usage": speech_usage(req, result)}))  # fmt: skip
        await response.write_eof()
        self._observe_done(result, rid, t0, n)
        return response

    async def _whole(self, chunks, req: SpeechRequest, result: Result, headers, rid, t0):
        parts = []
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    parts.append(chunk.pcm)
                    self._observe_chunk(chunk, result)
        except MAPPED as e:
            raise as_request_error(e) from None
        body = encode_whole(b"".join(parts), req.response_format)
        headers = {**headers, HEADER_VARIANT: self._served_by(result),
                   "Content-Type": CONTENT_TYPES[req.response_format]}  # fmt: skip
        self._observe_done(result, rid, t0, len(parts))
        return web.Response(body=body, headers=headers)

    def _voice(self, voice: str | None) -> str | None:
        """A model voice as asked, or the voice an alias names (unknown names stay for the
        model check to refuse, with the list of voices)."""
        if voice is None or voice.lower() in self.server.engine.active.info.get("voices", []):
            return voice
        return voice_aliases(self.server.engine, self.server.config).get(voice.lower(), voice)

    def _served_by(self, result: Result) -> str:
        return str(result.variant or self.server.engine.active.variant)

    def _observe_chunk(self, chunk, result: Result) -> None:
        variant = str(result.variant)
        if chunk.index == 0:
            self.server.metrics.first_audio.labels(variant).observe(result.first_audio_s or 0.0)
            self.server.metrics.queue_wait.labels(variant).observe(result.queue_wait_s)
        self.server.metrics.chunk_compute.labels(variant).observe(chunk.compute_s)

    def _observe_done(self, result: Result, rid: str, t0: float, n: int) -> None:
        total = time.perf_counter() - t0
        logger.info("%s done: variant %s, %d chunks, first audio %.3fs, total %.3fs", rid,
                    result.variant, n, result.first_audio_s or -1, total)  # fmt: skip
        span = trace.get_current_span()
        if not span.is_recording():
            return
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
        tracer.start_span("qwen3_tts.queue", start_time=start, attributes=attrs).end(end_time=queued)
        tracer.start_span("qwen3_tts.synthesis", start_time=queued, attributes=attrs).end(end_time=end)
