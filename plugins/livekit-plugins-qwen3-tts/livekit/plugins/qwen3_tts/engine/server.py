"""The engine server: one streaming HTTP protocol (OpenAI + vLLM-Omni fields) over handlers.

`POST /v1/audio/speech` streams s16le PCM, one HTTP chunk per 4-frame audio chunk, as each is
made; `/health`, `/ready`, `/v1/models` and `/metrics` serve operators and load balancers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import itertools
import json
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..log import logger
from ..protocol import (
    HEADER_MODEL,
    HEADER_REQUEST_ID,
    HEADER_SAMPLE_RATE,
    HEADER_VARIANT,
    SAMPLE_RATE,
    Limits,
    RequestError,
    SpeechRequest,
    parse_speech_request,
)
from .handler import Handler, HandlerError, QueueFull, RequestRejected, Result
from .recipes import RECIPES
from .ref_audio import resolve_ref_audio

_request_ids = itertools.count(1)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8880
    api_key: str | None = None  # bearer token for /v1/*; from QWEN3_TTS_API_KEY
    ref_audio_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 12 * 1024 * 1024
    max_queue: int = 32
    retry_after_s: int = 2


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_audio = Histogram(
            "qwen3_tts_first_audio_seconds", "Request arrival to first audio chunk", ["variant"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30), registry=r)  # fmt: skip
        self.chunk_compute = Histogram(
            "qwen3_tts_chunk_compute_seconds", "Worker compute per audio chunk", ["variant"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.32, 0.5, 1, 2, 5, 15), registry=r)  # fmt: skip
        self.queue_wait = Histogram(
            "qwen3_tts_queue_wait_seconds", "Time a request waited for its handler", ["variant"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30), registry=r)  # fmt: skip
        self.requests = Counter("qwen3_tts_requests_total", "Speech requests by HTTP status",
                                ["status"], registry=r)  # fmt: skip
        self.active_variant = Gauge("qwen3_tts_active_variant", "1 for the variant serving by default",
                                    ["variant"], registry=r)  # fmt: skip
        self.worker_memory = Gauge("qwen3_tts_worker_memory_bytes", "Handler worker memory",
                                   ["variant", "kind"], registry=r)  # fmt: skip
        self.queue_depth = Gauge("qwen3_tts_queue_depth", "Requests waiting or in flight",
                                 ["variant"], registry=r)  # fmt: skip


class Engine:
    """The handlers of one voice model, by variant; `active` serves requests that name none."""

    def __init__(self, model: str, handlers: list[Handler]) -> None:
        if not handlers:
            raise ValueError("an engine needs at least one handler")
        self.model = model
        self.handlers: dict[str, Handler] = {}
        self._order = handlers
        self.active: Handler = handlers[0]

    async def start(self) -> None:
        for h in self._order:
            await h.start()
            self.handlers[h.variant] = h
        self.active = self._order[0]

    async def stop(self) -> None:
        for h in list(self.handlers.values()):
            await h.stop(drain=False)

    def model_names(self) -> set[str]:
        base = self.model.rstrip("/").split("/")[-1]
        return {self.model, base, "qwen3-tts", "tts-1", "tts-1-hd"}

    def pick(self, req: SpeechRequest) -> Handler:
        if req.model is not None and req.model not in self.model_names():
            raise RequestError(f"model {req.model!r} is not served here; this engine serves "
                               f"{self.model!r}", param="model", status=404)  # fmt: skip
        if req.variant is None:
            return self.active
        if req.variant not in RECIPES:
            raise RequestError(f"unknown variant {req.variant!r}; valid variants: "
                               f"{', '.join(RECIPES)}", param="variant")  # fmt: skip
        handler = self.handlers.get(req.variant)
        if handler is None:
            raise RequestError(f"variant {req.variant!r} is not loaded; loaded: "
                               f"{', '.join(self.handlers)}", param="variant")  # fmt: skip
        return handler


def check_against_model(req: SpeechRequest, info: dict) -> None:
    """Reject, before any audio is sent, what the loaded model cannot do."""
    kind = info.get("tts_model_type")
    if req.task_type is not None and req.task_type != kind:
        raise RequestError(f"task_type {req.task_type!r} does not match this model ({kind})",
                           param="task_type")  # fmt: skip
    voices = info.get("voices", [])
    if kind == "custom_voice" and req.voice is not None and req.voice.lower() not in voices:
        raise RequestError(f"unknown voice {req.voice!r}; voices: {', '.join(voices)}", param="voice")
    if kind == "voice_design" and not req.instructions:
        raise RequestError("a VoiceDesign model needs `instructions`", param="instructions")
    if kind == "base" and req.voice is not None and req.voice.lower() not in voices:
        raise RequestError("Base models have no preset voices; send ref_audio instead", param="voice")
    if req.language not in info.get("languages", [req.language]):
        raise RequestError(f"language {req.language!r} is not supported by this model; "
                           f"languages: {', '.join(info['languages'])}", param="language")  # fmt: skip
    if req.ref_text and not req.ref_audio:
        raise RequestError("ref_text needs ref_audio", param="ref_text")
    if req.ref_audio and kind != "base":
        raise RequestError("ref_audio needs a Base model", param="ref_audio")


def wav_bytes(pcm: bytes, sample_rate: int = SAMPLE_RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buf.getvalue()


def _error(err: RequestError, headers: dict | None = None) -> web.Response:
    return web.json_response(err.to_json(), status=err.status, headers=headers)


class EngineServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = Metrics()
        self.app = web.Application(client_max_size=self.config.max_body_bytes,
                                   middlewares=[self._errors])  # fmt: skip
        self.app.add_routes([
            web.post("/v1/audio/speech", self.speech),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/v1/models", self.models),
            web.get("/v1/engine/status", self.status),
            web.get("/metrics", self.metrics_endpoint),
        ])  # fmt: skip
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind first (so /health answers while models load), then start the handlers."""
        # handler_cancellation: a client that disconnects cancels its synthesis at once.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        await self.engine.start()
        logger.info("engine server on http://%s:%d (model %s, variants %s)", self.config.host,
                    self.port, self.engine.model, ", ".join(self.engine.handlers))  # fmt: skip
        return self.port

    async def stop(self) -> None:
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
        key = self.config.api_key
        if not key:
            return True
        got = request.headers.get("Authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), key.encode())

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        h = self.engine.active
        body = {"ready": h.state == "ready", "variant": h.variant, "state": h.state,
                "queue_depth": h.queue_depth}  # fmt: skip
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(RequestError("missing or wrong bearer token", status=401))
        info = self.engine.active.info
        return web.json_response({"object": "list", "data": [{
            "id": self.engine.model, "object": "model", "owned_by": "qwen3-tts",
            "tts_model_type": info.get("tts_model_type"), "voices": info.get("voices", []),
            "languages": info.get("languages", []), "variants": list(self.engine.handlers),
            "active_variant": self.engine.active.variant, "sample_rate": SAMPLE_RATE,
        }]})  # fmt: skip

    async def status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(RequestError("missing or wrong bearer token", status=401))
        handlers = []
        for h in self.engine.handlers.values() or [self.engine.active]:
            info = {k: v for k, v in h.info.items() if k != "quantized_modules"}
            handlers.append({
                "name": h.name, "variant": h.variant, "state": h.state, "pid": h.pid,
                "active": h is self.engine.active, "queue_depth": h.queue_depth,
                "waiting": h.waiting, "restarts": h.restarts, "last_stats": h.last_stats,
                "memory": await h.memory(), "info": info,
                "quantized_modules": len(h.info.get("quantized_modules", {})),
            })  # fmt: skip
        return web.json_response({"model": self.engine.model,
                                  "active_variant": self.engine.active.variant,
                                  "handlers": handlers})  # fmt: skip

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        m = self.metrics
        for variant, h in self.engine.handlers.items():
            m.active_variant.labels(variant).set(1 if h is self.engine.active else 0)
            m.queue_depth.labels(variant).set(h.queue_depth)
            for kind, value in (await h.memory()).items():
                m.worker_memory.labels(variant, kind.removesuffix("_bytes")).set(value)
        body = generate_latest(m.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def speech(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(HEADER_REQUEST_ID) or f"tts-{next(_request_ids)}"
        t0 = time.perf_counter()
        try:
            response = await self._speech(request, rid, t0)
        except RequestError as e:
            self.metrics.requests.labels(str(e.status)).inc()
            headers = {"Retry-After": str(self.config.retry_after_s)} if e.status in (429, 503) else None
            logger.info("%s rejected (%d): %s", rid, e.status, e.message)
            return _error(e, headers)
        self.metrics.requests.labels(str(response.status)).inc()
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
        handler = self.engine.pick(req)
        check_against_model(req, handler.info)
        ref = resolve_ref_audio(req.ref_audio, self.config.ref_audio_dir,
                                self.config.limits.max_ref_audio_bytes)  # fmt: skip
        req.ref_audio = None  # the worker gets the bytes, not the encoded string
        result = Result()
        chunks = handler.synthesize(req, ref_audio=ref, result=result)  # errors surface on iteration
        headers = {HEADER_VARIANT: str(handler.variant), HEADER_MODEL: self.engine.model,
                   HEADER_SAMPLE_RATE: str(SAMPLE_RATE), HEADER_REQUEST_ID: rid}  # fmt: skip
        if req.stream and req.response_format == "pcm":
            return await self._stream(request, chunks, result, headers, rid, t0)
        return await self._whole(chunks, req, result, headers, rid, t0)

    async def _stream(self, request, chunks, result: Result, headers, rid, t0):
        response = web.StreamResponse(status=200, headers={**headers, "Content-Type": "audio/pcm"})
        response.enable_chunked_encoding()
        n = 0
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    if n == 0:
                        await response.prepare(request)
                    await response.write(chunk.pcm)
                    self._observe_chunk(chunk, result)
                    n += 1
            except (QueueFull, RequestRejected, HandlerError) as e:
                if n == 0:  # nothing sent yet: a proper error status is still possible
                    status = {QueueFull: 429, RequestRejected: 400}.get(type(e), 503)
                    raise RequestError(str(e), status=status) from None
                # Audio already went out: abort the connection so the client sees an error.
                logger.error("%s failed after %d chunks: %s", rid, n, e)
                self.metrics.requests.labels("aborted").inc()
                request.transport.close() if request.transport else None
                return response
            except (ConnectionResetError, asyncio.CancelledError):
                logger.info("%s: client went away after %d chunks; synthesis cancelled", rid, n)
                raise
        if n == 0:
            await response.prepare(request)
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
        except QueueFull as e:
            raise RequestError(str(e), status=429) from None
        except RequestRejected as e:
            raise RequestError(str(e)) from None
        except HandlerError as e:
            raise RequestError(str(e), status=503) from None
        pcm = b"".join(parts)
        self._observe_done(result, rid, t0, len(parts))
        if req.response_format == "wav":
            return web.Response(body=wav_bytes(pcm), headers={**headers, "Content-Type": "audio/wav"})
        return web.Response(body=pcm, headers={**headers, "Content-Type": "audio/pcm"})

    def _observe_chunk(self, chunk, result: Result) -> None:
        variant = str(result.variant)
        if chunk.index == 0:
            self.metrics.first_audio.labels(variant).observe(result.first_audio_s or 0.0)
            self.metrics.queue_wait.labels(variant).observe(result.queue_wait_s)
        self.metrics.chunk_compute.labels(variant).observe(chunk.compute_s)

    def _observe_done(self, result: Result, rid: str, t0: float, n: int) -> None:
        logger.info("%s done: variant %s, %d chunks, first audio %.3fs, total %.3fs", rid,
                    result.variant, n, result.first_audio_s or -1, time.perf_counter() - t0)  # fmt: skip


async def serve_forever(server: EngineServer) -> None:
    """Run until SIGTERM/SIGINT, then stop the handlers (their workers exit)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
