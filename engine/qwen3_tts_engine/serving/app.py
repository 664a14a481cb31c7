"""The engine server: one streaming HTTP protocol (OpenAI + vLLM-Omni fields) over handlers.

`POST /v1/audio/speech` streams s16le PCM, one HTTP chunk per 4-frame audio chunk, as each is
made; `/health`, `/ready`, `/v1/models`, `/v1/engine/*` (status, variant override) and
`/metrics` serve operators and load balancers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qwen3_tts_engine.audio import AudioEncoder, encode_whole
from qwen3_tts_engine.governor.governor import Governor, SwapRecord
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.footprint import breakdown
from qwen3_tts_engine.protocol import (
    CONTENT_TYPES,
    HEADER_MODEL,
    HEADER_REQUEST_ID,
    HEADER_SAMPLE_RATE,
    HEADER_VARIANT,
    OPENAI_VOICE_ALIASES,
    SAMPLE_RATE,
    STREAMED_FORMATS,
    EngineStatus,
    HandlerStatus,
    Limits,
    ModelCard,
    ReadyStatus,
    RequestError,
    SpeechRequest,
    VariantChange,
    parse_speech_request,
)
from qwen3_tts_engine.runtime.engine import Engine
from qwen3_tts_engine.runtime.handler import Result
from qwen3_tts_engine.runtime.ref_audio import resolve_ref_audio

from .auth import authorized, carries, exposure_problem
from .errors import MAPPED, as_request_error, error_response
from .metrics import Metrics
from .tracing import extract_context, tracer

_request_ids = itertools.count(1)


def sse_event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def speech_usage(req: SpeechRequest, result: Result) -> dict:
    """OpenAI's usage object for a speech: output tokens are the codec frames made (the model's
    audio tokens); input tokens count the input's characters (the server does not tokenize)."""
    frames = int((result.stats or {}).get("frames", 0))
    chars = len(req.input)
    return {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames}


class InsecureServerError(ValueError):
    """The server would listen on a network address without an API key."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8880
    api_key: str | None = None  # bearer token for /v1/*; from QWEN3_TTS_API_KEY
    operator_key: str | None = None  # alone may change the variant; from QWEN3_TTS_OPERATOR_KEY
    # serve a non-loopback host without an API key (refused otherwise)
    insecure_no_auth: bool = False
    ref_audio_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 12 * 1024 * 1024
    max_queue: int = 32
    retry_after_s: int = 2
    # voice names a request may use for the model's voices (OpenAI's by default)
    voice_aliases: dict[str, str] = field(default_factory=lambda: dict(OPENAI_VOICE_ALIASES))


class EngineServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 governor: Governor | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = Metrics()
        self.governor = governor
        if governor is not None:
            governor.listeners.append(self._count_swap)
        self._variants_seen: set[str] = set()
        self.app = web.Application(client_max_size=self.config.max_body_bytes,
                                   middlewares=[self._errors])  # fmt: skip
        self.app.add_routes([
            web.post("/v1/audio/speech", self.speech),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/v1/models", self.models),
            web.get("/v1/engine/status", self.status),
            web.post("/v1/engine/variant", self.set_variant),
            web.get("/metrics", self.metrics_endpoint),
        ])  # fmt: skip
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind first (so /health answers while models load), then start the handlers.

        Raises `InsecureServerError` for a non-loopback host without an API key, unless
        `insecure_no_auth` says the operator means it (then a warning, on every start)."""
        problem = exposure_problem(self.config.host, self.config.api_key, self.config.operator_key)
        if problem and not self.config.insecure_no_auth:
            raise InsecureServerError(problem)
        if problem:
            logger.warning("serving %s WITHOUT an API key (--insecure-no-auth): anyone who can "
                           "reach it can synthesize and read its status", self.config.host)  # fmt: skip
        # handler_cancellation: a client that disconnects cancels its synthesis at once.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        await self.engine.start()
        if self.governor is not None:
            await self.governor.start()
        logger.info("engine server on http://%s:%d (model %s, variants %s)", self.config.host,
                    self.port, self.engine.model, ", ".join(self.engine.handlers))  # fmt: skip
        return self.port

    async def stop(self) -> None:
        if self.governor is not None:
            await self.governor.stop()
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- middleware and auth -----------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400 and e.content_type != "application/json":
                err = RequestError(e.reason or "error", status=e.status)
                return web.json_response(err.to_json(), status=e.status)
            raise

    def _authorized(self, request: web.Request) -> bool:
        return authorized(request.headers.get("Authorization"), self.config.api_key,
                          self.config.operator_key)  # fmt: skip

    def _operator_refusal(self, request: web.Request) -> RequestError | None:
        """Why this request may not change the variant (None: it may)."""
        header = request.headers.get("Authorization")
        if not self.config.operator_key:
            ok = authorized(header, self.config.api_key)
            return None if ok else RequestError("missing or wrong bearer token", status=401)
        if carries(header, self.config.operator_key):
            return None
        if self.config.api_key and carries(header, self.config.api_key):
            return RequestError("changing the variant needs the operator key "
                                "(QWEN3_TTS_OPERATOR_KEY), not the API key", status=403)  # fmt: skip
        return RequestError("missing or wrong bearer token (the operator key)", status=401)

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        h = self.engine.active
        # Not ready before the governor has fixed its ladder (the quality gate hashes checkpoints).
        started = self.governor is None or self.governor.started
        body = ReadyStatus(ready=h.state == "ready" and self.engine.serving and started,
                           variant=h.variant, state=h.state, queue_depth=h.queue_depth,
                           swapping=self.governor is not None and self.governor.swapping is not None)
        return web.json_response(body.to_json(), status=200 if body.ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_response(RequestError("missing or wrong bearer token", status=401))
        info = self.engine.active.info
        card = ModelCard(id=self.engine.model, tts_model_type=info.get("tts_model_type"),
                         voices=info.get("voices", []), languages=info.get("languages", []),
                         variants=list(self.engine.handlers),
                         active_variant=self.engine.active.variant,
                         voice_aliases=self._voice_aliases())
        return web.json_response({"object": "list", "data": [card.to_json()]})

    async def status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_response(RequestError("missing or wrong bearer token", status=401))
        handlers = []
        for h in self.engine.all_handlers():
            info = {k: v for k, v in h.info.items() if k not in ("quantized_modules", "footprint")}
            memory = await h.memory()
            handlers.append(HandlerStatus(
                name=h.name, variant=h.variant, state=h.state, pid=h.pid,
                active=h is self.engine.active, retiring=h in self.engine.retiring,
                queue_depth=h.queue_depth, waiting=h.waiting, restarts=h.restarts,
                last_stats=h.last_stats, memory=memory, info=info,
                quantized_modules=len(h.info.get("quantized_modules", {})),
                footprint=breakdown(h.info.get("footprint"), memory) if memory else {},
                batching={**h.batching, "max_batch": h.max_batch, "in_flight": h.in_flight},
            ))  # fmt: skip
        governor = await self.governor.status() if self.governor is not None else None
        status = EngineStatus(model=self.engine.model, active_variant=self.engine.active.variant,
                              serving=self.engine.serving, waiting_for_swap=self.engine.gap_waiting,
                              handlers=handlers, governor=governor)  # fmt: skip
        return web.json_response(status.to_json())

    async def set_variant(self, request: web.Request) -> web.Response:
        """Operator override: swap to a variant now (pinned unless `pin` is false), or "auto"."""
        refusal = self._operator_refusal(request)
        if refusal is not None:
            return error_response(refusal)
        if self.governor is None:
            return error_response(RequestError("this engine runs without a governor", status=409))
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(RequestError("request body is not valid JSON"))
        if not isinstance(body, dict) or not isinstance(body.get("variant"), str):
            return error_response(RequestError("body must be {\"variant\": \"4bit\" | \"auto\", "
                                       "\"mode\"?: ..., \"pin\"?: true}", param="variant"))  # fmt: skip
        mode, pin = body.get("mode", "auto"), body.get("pin", True)
        if not isinstance(pin, bool):
            return error_response(RequestError("pin must be true or false", param="pin"))
        try:
            record = await self.governor.request(body["variant"], mode=mode, pin=pin)
        except MAPPED as e:
            return error_response(e)
        except (ValueError, FileNotFoundError) as e:
            return error_response(RequestError(str(e), param="variant"))
        status = 200 if record is None or record.ok else 503
        change = VariantChange(active_variant=self.engine.active.variant,
                               pinned=self.governor.pinned,
                               swap=record.as_dict() if record else None)
        return web.json_response(change.to_json(), status=status)

    def _count_swap(self, record: SwapRecord) -> None:
        m = self.metrics
        m.swaps.labels(record.direction, record.cause, record.mode,
                       "ok" if record.ok else "failed").inc()  # fmt: skip
        if record.latency_s is not None:
            m.swap_seconds.labels(record.mode).observe(record.latency_s)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        m = self.metrics
        handlers = self.engine.all_handlers()
        self._variants_seen |= {str(h.variant) for h in handlers}
        if self.governor is not None:  # a variant may have come and gone between two scrapes
            self._variants_seen |= set(self.governor.policy.ladder)
        for variant in self._variants_seen:  # swapped-out variants read 0, not a stale 1
            m.active_variant.labels(variant).set(1 if variant == self.engine.active.variant else 0)
            m.queue_depth.labels(variant).set(sum(h.queue_depth for h in handlers
                                                  if str(h.variant) == variant))  # fmt: skip
        for h in handlers:
            for kind, value in (await h.memory()).items():
                m.worker_memory.labels(str(h.variant), kind.removesuffix("_bytes")).set(value)
            m.observe_batching(str(h.variant), h.in_flight, h.batching)
        if self.governor is not None:
            g = self.governor
            if g.reading is not None:
                m.memory_pressure.labels(g.reading.source).set(g.reading.pressure)
                for kind in ("limit", "used", "available"):
                    m.memory.labels(kind).set(getattr(g.reading, f"{kind}_bytes"))
            if g.position is not None:
                m.ladder_position.set(g.position)
            for variant in g.policy.ladder:
                if (fp := g.footprints.get(variant)) is not None:
                    m.footprint.labels(variant).set(fp)
        body = generate_latest(m.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

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
                return error_response(e, retry_after_s=self.config.retry_after_s)
            self.metrics.requests.labels(str(response.status)).inc()
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _speech(self, request: web.Request, rid: str, t0: float) -> web.StreamResponse:
        if not self._authorized(request):
            raise RequestError("missing or wrong bearer token", status=401)
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError("request body is too large", status=413) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("request body is not valid JSON") from None
        req = parse_speech_request(body, self.config.limits)
        req.voice = self._voice(req.voice)
        self.engine.validate(req)
        ref = resolve_ref_audio(req.ref_audio, self.config.ref_audio_dir,
                                self.config.limits.max_ref_audio_bytes)  # fmt: skip
        req.ref_audio = None  # the worker gets the bytes, not the encoded string
        result = Result()
        # Errors surface on iteration; the handler (and so the variant) is chosen when the
        # synthesis starts, which may be after a variant swap.
        chunks = self.engine.stream(req, ref_audio=ref, result=result)
        headers = {HEADER_MODEL: self.engine.model, HEADER_SAMPLE_RATE: str(SAMPLE_RATE),
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
                    self.metrics.requests.labels("aborted").inc()
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

    def _voice_aliases(self) -> dict[str, str]:
        """The aliases whose voice this model has."""
        voices = set(self.engine.active.info.get("voices", []))
        return {a.lower(): v for a, v in self.config.voice_aliases.items() if v.lower() in voices}

    def _voice(self, voice: str | None) -> str | None:
        """A model voice as asked, or the voice an alias names (unknown names stay for the
        model check to refuse, with the list of voices)."""
        if voice is None or voice.lower() in self.engine.active.info.get("voices", []):
            return voice
        return self._voice_aliases().get(voice.lower(), voice)

    def _served_by(self, result: Result) -> str:
        return str(result.variant or self.engine.active.variant)

    def _observe_chunk(self, chunk, result: Result) -> None:
        variant = str(result.variant)
        if chunk.index == 0:
            self.metrics.first_audio.labels(variant).observe(result.first_audio_s or 0.0)
            self.metrics.queue_wait.labels(variant).observe(result.queue_wait_s)
        self.metrics.chunk_compute.labels(variant).observe(chunk.compute_s)

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


async def serve_forever(server: EngineServer) -> None:
    """Run until SIGTERM/SIGINT, then stop the handlers (their workers exit). Traces go to the
    OTLP endpoint in the environment, if one is set (flushed at the end)."""
    import signal

    from .tracing import configure_from_env

    provider = configure_from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
        if provider is not None:
            provider.shutdown()
