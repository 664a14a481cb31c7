"""The operator's endpoints of an `EngineServer`: liveness, readiness and load for load
balancers and routers, the model card, the engine's status, the variant override, the step
delay fault switched while serving, and Prometheus metrics (docs/fleet.md: what a router reads)."""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qwen3_tts_engine.dispatch.engine import Engine, MemoryBand
from qwen3_tts_engine.governor.governor import Governor, SwapRecord
from qwen3_tts_engine.models.footprint import breakdown
from qwen3_tts_engine.protocol import (
    SPEECH_STREAM_PATH,
    EngineStatus,
    HandlerStatus,
    LoadReport,
    ModelCard,
    ReadyStatus,
    RequestError,
    VariantChange,
)
from qwen3_tts_engine.serving.errors import MAPPED, error_response
from qwen3_tts_engine.serving.metrics import Metrics
from qwen3_tts_engine.serving.server_config import ServerConfig
from qwen3_tts_engine.serving.speech_service import voice_aliases

MAX_FAULT_STEP_DELAY_MS = 60_000  # a step delay past a minute is a typo, not a drill


class OperatorRoutes:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics, governor: Governor | None,
                 *, sessions: Callable[[], tuple[int, int]]) -> None:  # fmt: skip
        self.engine, self.config, self.metrics, self.governor = engine, config, metrics, governor
        self.sessions = sessions  # (WebSocket sessions open, those waiting for their text)
        self._variants_seen: set[str] = set()
        if governor is not None:
            governor.listeners.append(self._count_swap)

    def routes(self) -> list[web.RouteDef]:
        # the fault route exists only where the server was started to allow it: a drill setting
        fault = (
            [web.post("/v1/engine/fault", self.set_fault)]
            if self.config.allow_fault_injection
            else []
        )
        return [
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/load", self.load),
            web.get("/get_load", self.get_load),
            web.get("/v1/models", self.models),
            web.get("/v1/engine/status", self.status),
            web.post("/v1/engine/variant", self.set_variant),
            *fault,
            web.get("/metrics", self.metrics_endpoint),
        ]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """200 while the engine takes new work as it comes (`state` serving in its load report);
        503 while it loads (before the governor has fixed its ladder too), drains or swaps, in
        either swap mode: a router sends new streams elsewhere until the new variant serves."""
        h = self.engine.active
        load = self.load_report()
        body = ReadyStatus(ready=load.state == "serving", variant=h.variant, state=h.state,
                           queue_depth=h.queue_depth, swapping=load.state == "swapping")  # fmt: skip
        return web.json_response(body.to_json(), status=200 if body.ready else 503)

    def load_report(self) -> LoadReport:
        g = self.governor
        memory = None
        if g is not None and g.reading is not None:
            memory = MemoryBand(g.reading.pressure, g.policy.upgrade_at, g.policy.critical_at)
        report = self.engine.load(swapping=g is not None and g.swapping is not None,
                                  started=g is None or g.started, memory=memory)  # fmt: skip
        report.sessions, report.sessions_waiting_for_text = self.sessions()
        return report

    async def load(self, request: web.Request) -> web.Response:
        """Running and waiting streams, real-time slots and state: no auth (as /ready), no
        worker round trip (routers and the plugin poll it)."""
        return web.json_response(self.load_report().to_json())

    async def get_load(self, request: web.Request) -> web.Response:
        """`{"load": N}`, N = streams running + waiting: the shape vllm-router's power_of_two
        policy reads (vllm-project/router #174); public, as /load."""
        return web.json_response({"load": self.load_report().server_load})

    async def models(self, request: web.Request) -> web.Response:
        info = self.engine.active.info
        card = ModelCard(
            id=self.engine.model,
            tts_model_type=info.get("tts_model_type"),
            voices=info.get("voices", []),
            languages=info.get("languages", []),
            variants=list(self.engine.handlers),
            active_variant=self.engine.active.variant,
            voice_aliases=voice_aliases(self.engine, self.config),
        )
        return web.json_response({"object": "list", "data": [card.to_json()]})

    async def status(self, request: web.Request) -> web.Response:
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
                              handlers=handlers, governor=governor, streaming_text=True,
                              streaming_text_route=SPEECH_STREAM_PATH,
                              capacity=self.load_report().to_json())  # fmt: skip
        return web.json_response(status.to_json())

    async def set_variant(self, request: web.Request) -> web.Response:
        """Operator override: swap to a variant now (pinned unless `pin` is false), or "auto"."""
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
        change = VariantChange(
            active_variant=self.engine.active.variant,
            pinned=self.governor.pinned,
            swap=record.as_dict() if record else None,
        )
        return web.json_response(change.to_json(), status=status)

    async def set_fault(self, request: web.Request) -> web.Response:
        """Fault injection while serving (drills, tests; docs/fleet.md; served only with
        `--allow-fault-injection`): {"step_delay_ms": X}
        makes every batch step of every handler's worker sleep X ms per stream in it from its
        next step on, as `--fault-step-delay-ms` does from the start; 0 switches it off."""
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(RequestError("request body is not valid JSON"))
        delay = body.get("step_delay_ms") if isinstance(body, dict) else None
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not 0 <= delay <= MAX_FAULT_STEP_DELAY_MS
        ):
            return error_response(RequestError("body must be {\"step_delay_ms\": 0.."
                                               f"{MAX_FAULT_STEP_DELAY_MS}}}", param="step_delay_ms"))  # fmt: skip
        handlers = self.engine.all_handlers()
        for h in handlers:
            h.set_step_delay(delay / 1000)
        return web.json_response({"step_delay_ms": delay, "handlers": [h.name for h in handlers]})

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
        m.observe_load(self.engine.model, self.load_report())
        for h in handlers:
            m.observe_steps(str(h.variant), h.take_step_samples())
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
