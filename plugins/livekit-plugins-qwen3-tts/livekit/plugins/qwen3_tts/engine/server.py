"""The engine server: one streaming HTTP protocol (OpenAI + vLLM-Omni fields) over handlers.

`POST /v1/audio/speech` streams s16le PCM, one HTTP chunk per 4-frame audio chunk, as each is
made; `/health`, `/ready`, `/v1/models`, `/v1/engine/*` (status, variant override) and
`/metrics` serve operators and load balancers.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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
from .handler import (
    AudioChunk,
    Handler,
    HandlerDraining,
    HandlerError,
    QueueFull,
    RequestRejected,
    Result,
)
from .recipes import RECIPES
from .ref_audio import resolve_ref_audio

if TYPE_CHECKING:
    from .governor import Governor, SwapRecord

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
        # The memory-pressure governor.
        self.swaps = Counter("qwen3_tts_variant_swaps_total", "Variant swaps",
                             ["direction", "reason", "mode", "result"], registry=r)  # fmt: skip
        self.swap_seconds = Histogram(
            "qwen3_tts_variant_swap_seconds", "Swap decision to the new variant serving", ["mode"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)  # fmt: skip
        self.memory_pressure = Gauge("qwen3_tts_memory_pressure", "Used fraction of the memory "
                                     "limit the governor watches", ["source"], registry=r)  # fmt: skip
        self.memory = Gauge("qwen3_tts_memory_bytes", "The governor's memory reading",
                            ["kind"], registry=r)  # fmt: skip
        self.ladder_position = Gauge("qwen3_tts_ladder_position",
                                     "Rung of the active variant (0 = largest)", registry=r)  # fmt: skip
        self.footprint = Gauge("qwen3_tts_variant_footprint_bytes",
                               "Worker memory per variant (measured or estimated)", ["variant"],
                               registry=r)  # fmt: skip


class Engine:
    """The handlers of one voice model, by variant; `active` serves requests that name none.

    Swaps (the governor's) go through `hold`, `route_to` and `forget`: during a break-before-make
    swap no handler takes new work and requests wait in `acquire()` until the next one serves;
    a handler replaced by a make-before-break swap finishes its utterances in `retiring`.
    """

    def __init__(self, model: str, handlers: list[Handler], *, wait_timeout: float = 1800.0) -> None:
        if not handlers:
            raise ValueError("an engine needs at least one handler")
        self.model = model
        self.handlers: dict[str, Handler] = {}
        self._order = handlers
        self.active: Handler = handlers[0]
        self.retiring: list[Handler] = []
        self.info: dict = {}  # model info (voices, languages): the same for every variant
        self.pending_variant: str | None = None  # what a break-before-make swap is loading
        self.wait_timeout = wait_timeout
        self.gap_waiting = 0
        self._serving = asyncio.Event()

    async def start(self) -> None:
        for h in self._order:
            await h.start()
            self.handlers[h.variant] = h
        self.active = self._order[0]
        self.info = self.active.info
        self._serving.set()

    async def stop(self) -> None:
        for h in [*self.handlers.values(), *self.retiring]:
            await h.stop(drain=False)

    @property
    def serving(self) -> bool:
        """False while a break-before-make swap is between handlers."""
        return self._serving.is_set()

    def all_handlers(self) -> list[Handler]:
        """The active handler first, then the other loaded ones, then those being retired."""
        others = [h for h in self.handlers.values() if h is not self.active]
        return [self.active, *others, *(h for h in self.retiring if h is not self.active)]

    def model_names(self) -> set[str]:
        base = self.model.rstrip("/").split("/")[-1]
        return {self.model, base, "qwen3-tts", "tts-1", "tts-1-hd"}

    def _check_names(self, req: SpeechRequest) -> None:
        if req.model is not None and req.model not in self.model_names():
            raise RequestError(f"model {req.model!r} is not served here; this engine serves "
                               f"{self.model!r}", param="model", status=404)  # fmt: skip
        if req.variant is not None and req.variant not in RECIPES:
            raise RequestError(f"unknown variant {req.variant!r}; valid variants: "
                               f"{', '.join(RECIPES)}", param="variant")  # fmt: skip

    def pick(self, req: SpeechRequest) -> Handler:
        """The handler for `req` right now (the active one unless it names a variant)."""
        self._check_names(req)
        if req.variant is None:
            return self.active
        handler = self.handlers.get(req.variant)
        if handler is None:
            raise RequestError(f"variant {req.variant!r} is not loaded; loaded: "
                               f"{', '.join(self.handlers)}", param="variant")  # fmt: skip
        return handler

    def validate(self, req: SpeechRequest) -> None:
        """Reject, before any waiting, what no handler here can serve."""
        self._check_names(req)
        if req.variant is not None and req.variant != self.pending_variant:
            check_against_model(req, self.pick(req).info)
        else:
            check_against_model(req, self.info)

    async def acquire(self, req: SpeechRequest) -> Handler:
        """The handler for `req`, waiting while a break-before-make swap is between handlers."""
        if req.variant is not None and req.variant != self.pending_variant:
            return self.pick(req)
        if not self._serving.is_set():
            if self.gap_waiting >= self.active.max_queue:
                raise RequestError(f"{self.gap_waiting} requests are already waiting for a "
                                   "variant swap", status=429)  # fmt: skip
            self.gap_waiting += 1
            try:
                await asyncio.wait_for(self._serving.wait(), self.wait_timeout)
            except TimeoutError:
                raise RequestError("no variant came back into service", status=503) from None
            finally:
                self.gap_waiting -= 1
        if self.active.state == "stopped":
            raise RequestError("no variant is loaded (a swap failed)", status=503)
        return self.pick(req)

    async def stream(
        self, req: SpeechRequest, *, ref_audio: bytes | None = None, result: Result | None = None
    ) -> AsyncIterator[AudioChunk]:
        """Chunks for `req` from the right handler; a request that a handler let go before it
        started (the handler is being swapped out) is routed to the next one, never dropped."""
        result = result if result is not None else Result()
        t0 = time.perf_counter()
        for _ in range(8):
            handler = await self.acquire(req)
            waited = time.perf_counter() - t0
            chunks = handler.synthesize(req, ref_audio=ref_audio, result=result)
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        if chunk.index == 0:  # count the wait for a swap as queue wait
                            result.queue_wait_s += waited
                            result.first_audio_s = (result.first_audio_s or 0.0) + waited
                        yield chunk
                return
            except HandlerDraining:
                if result.first_audio_s is not None:
                    raise
                logger.debug("request moved off draining handler %s", handler.name)
        raise HandlerError("no handler would take the request (swaps kept replacing them)")

    # -- swap primitives (the governor's) ---------------------------------------------------

    def hold(self, target: str) -> None:
        """Break before make: new requests wait until `route_to` names the next handler."""
        self.pending_variant = target
        self._serving.clear()

    def route_to(self, new: Handler, old: Handler | None = None) -> None:
        """New requests go to `new`; `old` (still working) moves to `retiring`."""
        if old is not None:
            if self.handlers.get(old.variant) is old:
                del self.handlers[old.variant]
            if old.state != "stopped" and old not in self.retiring:
                self.retiring.append(old)
        self.handlers[new.variant] = new
        self.active = new
        self.info = new.info or self.info
        self.pending_variant = None
        self._serving.set()

    def forget(self, handler: Handler) -> None:
        """A retired handler has stopped: it leaves the engine."""
        if handler in self.retiring:
            self.retiring.remove(handler)

    def resume(self) -> None:
        """End a gap without a new handler (a failed swap): waiting requests get an answer."""
        self.pending_variant = None
        self._serving.set()


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
        """Bind first (so /health answers while models load), then start the handlers."""
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
        # Not ready before the governor has fixed its ladder (the quality gate hashes checkpoints).
        started = self.governor is None or self.governor.started
        body = {"ready": h.state == "ready" and self.engine.serving and started, "variant": h.variant,
                "state": h.state, "queue_depth": h.queue_depth,
                "swapping": self.governor is not None and self.governor.swapping is not None}  # fmt: skip
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
        for h in self.engine.all_handlers():
            info = {k: v for k, v in h.info.items() if k != "quantized_modules"}
            handlers.append({
                "name": h.name, "variant": h.variant, "state": h.state, "pid": h.pid,
                "active": h is self.engine.active, "retiring": h in self.engine.retiring,
                "queue_depth": h.queue_depth,
                "waiting": h.waiting, "restarts": h.restarts, "last_stats": h.last_stats,
                "memory": await h.memory(), "info": info,
                "quantized_modules": len(h.info.get("quantized_modules", {})),
            })  # fmt: skip
        governor = await self.governor.status() if self.governor is not None else None
        return web.json_response({"model": self.engine.model,
                                  "active_variant": self.engine.active.variant,
                                  "serving": self.engine.serving,
                                  "waiting_for_swap": self.engine.gap_waiting,
                                  "handlers": handlers, "governor": governor})  # fmt: skip

    async def set_variant(self, request: web.Request) -> web.Response:
        """Operator override: swap to a variant now (pinned unless `pin` is false), or "auto"."""
        from .governor import SwapInProgress

        if not self._authorized(request):
            return _error(RequestError("missing or wrong bearer token", status=401))
        if self.governor is None:
            return _error(RequestError("this engine runs without a governor", status=409))
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(RequestError("request body is not valid JSON"))
        if not isinstance(body, dict) or not isinstance(body.get("variant"), str):
            return _error(RequestError("body must be {\"variant\": \"4bit\" | \"auto\", "
                                       "\"mode\"?: ..., \"pin\"?: true}", param="variant"))  # fmt: skip
        mode, pin = body.get("mode", "auto"), body.get("pin", True)
        if not isinstance(pin, bool):
            return _error(RequestError("pin must be true or false", param="pin"))
        try:
            record = await self.governor.request(body["variant"], mode=mode, pin=pin)
        except SwapInProgress as e:
            return _error(RequestError(str(e), status=409))
        except (ValueError, FileNotFoundError) as e:
            return _error(RequestError(str(e), param="variant"))
        status = 200 if record is None or record.ok else 503
        return web.json_response({"active_variant": self.engine.active.variant,
                                  "pinned": self.governor.pinned,
                                  "swap": record.as_dict() if record else None}, status=status)  # fmt: skip

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
                        response.headers[HEADER_VARIANT] = self._served_by(result)
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
                if request.transport is not None:
                    request.transport.close()
                return response
            except (ConnectionResetError, asyncio.CancelledError):
                logger.info("%s: client went away after %d chunks; synthesis cancelled", rid, n)
                raise
        if n == 0:
            response.headers[HEADER_VARIANT] = self._served_by(result)
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
        headers = {**headers, HEADER_VARIANT: self._served_by(result)}
        self._observe_done(result, rid, t0, len(parts))
        if req.response_format == "wav":
            return web.Response(body=wav_bytes(pcm), headers={**headers, "Content-Type": "audio/wav"})
        return web.Response(body=pcm, headers={**headers, "Content-Type": "audio/pcm"})

    def _served_by(self, result: Result) -> str:
        return str(result.variant or self.engine.active.variant)

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
