"""`POST /v1/audio/speech`: OpenAI's speech request (plus vLLM-Omni's Qwen3-TTS fields), audio
streamed as it is made: raw PCM chunks (or another format) in one chunked HTTP response, or
OpenAI's `speech.audio.delta` server-sent events. The route parses and delegates to the engine
(`dispatch/engine.py`); errors are `errors.py`'s OpenAI-style bodies. Why the utterance ended
(`protocol.FINISH_REASONS`) is in `X-Finish-Reason` on a whole response (and on a 5xx answer:
"error") and in the SSE `speech.audio.done` event; a raw streamed response has sent its headers
before the end is known and carries none (docs/engine-api.md, "Finish reasons").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time

from aiohttp import web
from opentelemetry.trace import SpanKind, StatusCode

from qwen3_tts_engine.audio import AudioEncoder, encode_whole
from qwen3_tts_engine.dispatch.handler import Result
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    CONTENT_TYPES,
    HEADER_CAPPED,
    HEADER_FINISH_REASON,
    HEADER_MODEL,
    HEADER_REQUEST_ID,
    HEADER_SAMPLE_RATE,
    HEADER_VARIANT,
    STREAMED_FORMATS,
    RequestError,
    SpeechRequest,
)
from qwen3_tts_engine.serving.errors import MAPPED, as_request_error, error_response
from qwen3_tts_engine.serving.speech_service import SpeechService, capped, decode_json
from qwen3_tts_engine.serving.tracing import extract_context, tracer

_request_ids = itertools.count(1)


def sse_event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def speech_usage(req: SpeechRequest, result: Result) -> dict:
    """OpenAI's usage object for a speech: output tokens are the codec frames made (the model's
    audio tokens); input tokens count the input's characters (the server does not tokenize)."""
    frames = int((result.stats or {}).get("frames", 0))
    chars = len(req.input)
    return {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames}


class SpeechRoutes:
    """`POST /v1/audio/speech` over the speech service."""

    def __init__(self, service: SpeechService) -> None:
        self.service = service
        self.config = service.config
        self.metrics = service.metrics

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
                self.metrics.requests.labels(str(e.status)).inc()
                logger.info("%s rejected (%d): %s", rid, e.status, e.message)
                span.set_attribute("http.response.status_code", e.status)
                span.set_status(StatusCode.ERROR, e.message)
                response = error_response(e, retry_after_s=self.config.retry_after_s)
                if e.status >= 500:  # the engine failed it (a 4xx refused it: no utterance ran)
                    response.headers[HEADER_FINISH_REASON] = self.service.observe_finish(
                        "error", rid
                    )
                return response
            self.metrics.requests.labels(str(response.status)).inc()
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _speech(self, request: web.Request, rid: str, t0: float) -> web.StreamResponse:
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError("request body is too large", status=413) from None
        req, ref = self.service.prepare(decode_json(data, "request body"), streamed=False)
        result = Result()
        chunks = self.service.stream(req, ref, result)
        headers = {HEADER_MODEL: self.service.engine.model, HEADER_SAMPLE_RATE: str(req.sample_rate),
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
        encoder = AudioEncoder(req.response_format, req.sample_rate)

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
                            response.headers[HEADER_VARIANT] = self.service.served_by(result)
                            await response.prepare(request)
                        await send(encoder.encode(chunk.pcm))
                        self.service.observe_chunk(chunk, result)
                        n += 1
                except MAPPED as e:
                    if n == 0:  # nothing sent yet: a proper error status is still possible
                        raise as_request_error(e) from None
                    # Audio already went out: abort the connection so the client sees an error.
                    logger.error("%s failed after %d chunks: %s", rid, n, e)
                    self.metrics.requests.labels("aborted").inc()
                    self.service.observe_finish("error", rid)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                except (ConnectionResetError, asyncio.CancelledError):
                    logger.info("%s: client went away after %d chunks; synthesis cancelled", rid, n)
                    self.service.observe_abort(rid)
                    raise
            # the synthesis is over: counted once, by its reason, before its end goes out
            reason = self.service.observe_done(result, rid, t0, n)
            if n == 0:
                response.headers[HEADER_VARIANT] = self.service.served_by(result)
                response.headers[HEADER_FINISH_REASON] = reason  # no audio: headers still unsent
                await response.prepare(request)
            await send(encoder.finish())
        finally:
            encoder.close()
        if sse:
            await response.write(sse_event({"type": "speech.audio.done", "finish_reason": reason,
                                            "capped": capped(result),
                                            "usage": speech_usage(req, result)}))  # fmt: skip
        await response.write_eof()
        return response

    async def _whole(self, chunks, req: SpeechRequest, result: Result, headers, rid, t0):
        parts = []
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    parts.append(chunk.pcm)
                    self.service.observe_chunk(chunk, result)
        except MAPPED as e:
            raise as_request_error(e) from None
        except (ConnectionResetError, asyncio.CancelledError):  # the client went away
            self.service.observe_abort(rid)
            raise
        body = encode_whole(b"".join(parts), req.response_format, req.sample_rate)
        headers = {**headers, HEADER_VARIANT: self.service.served_by(result),
                   "Content-Type": CONTENT_TYPES[req.response_format]}  # fmt: skip
        if capped(result):  # a streamed response's headers went out first: its SSE done event
            headers[HEADER_CAPPED] = "true"
        headers[HEADER_FINISH_REASON] = self.service.observe_done(result, rid, t0, len(parts))
        return web.Response(body=body, headers=headers)
