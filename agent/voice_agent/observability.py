"""Per-turn metrics: one log line per turn, Prometheus metrics, and a `/health` endpoint.

LiveKit puts each turn's latencies on `ChatMessage.metrics`; `TurnMetrics` collects them from a
session's `conversation_item_added` events, and counts turns, interruptions and component errors.
In `voice-agent start|dev` they are observed in the job processes and exported by LiveKit's worker
`/metrics` (prometheus-client multiprocess mode: `metrics_dir.use_multiprocess_dir` runs before anything
imports prometheus_client); `voice-agent demo` serves them itself (`start_metrics_server`).
"""

from __future__ import annotations

import logging
import os

from aiohttp import web
from livekit.agents import AgentSession, llm
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

logger = logging.getLogger("voice_agent")
_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2, 3, 5, 10, 30)
# (ChatMessage.metrics key, role of the message that carries it)
TURN_METRICS = {
    "end_of_turn_delay": "user", "transcription_delay": "user", "llm_node_ttft": "assistant",
    "tts_node_ttfb": "assistant", "e2e_latency": "assistant",
}  # fmt: skip
_HISTOGRAMS = {
    name: Histogram(
        f"voice_agent_{name}_seconds", f"Per-turn {name} (LiveKit metrics)", buckets=_BUCKETS
    )  # fmt: skip
    for name in TURN_METRICS
}
# what the pipeline adds beyond the parts LiveKit measures: e2e - end of turn - LLM TTFT - TTS TTFB
ADDED_LATENCY = Histogram("voice_agent_added_latency_seconds", "Per-turn voice-to-voice latency "
                          "beyond end of turn, LLM time to first token and TTS first audio",
                          buckets=(0.01, 0.02, 0.05, *_BUCKETS[1:]))  # fmt: skip
TURNS = Counter("voice_agent_turns", "Turns the agent answered (an assistant message)")
APOLOGIES = Counter("voice_agent_apologies", "Replies that were the apology for a failed LLM")
INTERRUPTIONS = Counter("voice_agent_interruptions", "Agent replies cut short by the user")
ERRORS = Counter("voice_agent_errors", "Component errors (recoverable: LiveKit retries or falls "
                 "back; not: the turn failed)", ["component", "recoverable"])  # fmt: skip
STANDBY = Counter("voice_agent_tts_standby", "Phrases said while no TTS engine could speak: "
                  "'hold' (One moment, please.) and 'apology'; source: the engine's voice "
                  "(cached) or the bundled clip", ["phrase", "source"])  # fmt: skip
TTS_FINISHES = Counter("voice_agent_tts_finish", "TTS utterances by why the engine ended them "
                       "(the plugin's finish_reason: stop, length, repetition, abort, error)",
                       ["reason"])  # fmt: skip
COMPONENTS = {"stt_error": "stt", "llm_error": "llm", "tts_error": "tts"}
for _phrase in ("hold", "apology"):
    for _source in ("engine", "bundled"):
        STANDBY.labels(_phrase, _source)
for _reason in ("stop", "length", "repetition", "abort", "error"):
    TTS_FINISHES.labels(_reason)
for _c in COMPONENTS.values():  # every series exists from the start (rate() needs a zero)
    for _r in ("true", "false"):
        ERRORS.labels(_c, _r)


class TurnMetrics:
    def __init__(self, session: AgentSession) -> None:
        self._user: dict = {}
        session.on("conversation_item_added", lambda ev: self.observe(ev.item))
        session.on("error", self._on_error)

    def _on_error(self, ev) -> None:
        component = COMPONENTS.get(getattr(ev.error, "type", None))
        if component is not None:
            ERRORS.labels(component, str(bool(ev.error.recoverable)).lower()).inc()

    def observe(self, item) -> None:
        if not isinstance(item, llm.ChatMessage):
            return
        values = {
            k: v
            for k, v in item.metrics.items()
            if k in TURN_METRICS and TURN_METRICS[k] == item.role
        }
        for k, v in values.items():
            if isinstance(v, int | float):
                _HISTOGRAMS[k].observe(v)
        if item.role == "user":
            self._user = values
        elif item.role == "assistant":
            turn = {**self._user, **values}
            self._user = {}
            TURNS.inc()
            if item.interrupted:
                INTERRUPTIONS.inc()
            parts = [
                turn.get(k)
                for k in ("e2e_latency", "end_of_turn_delay", "llm_node_ttft", "tts_node_ttfb")
            ]
            if all(isinstance(v, int | float) for v in parts):
                added = parts[0] - sum(parts[1:])
                turn["added_latency"] = added
                ADDED_LATENCY.observe(max(0.0, added))
            logger.info("turn: %s", " ".join(f"{k}={v:.3f}s" for k, v in turn.items()
                                                 if isinstance(v, int | float)))  # fmt: skip


async def start_metrics_server(port: int) -> web.AppRunner:
    """`/metrics` (Prometheus) and `/health` on 127.0.0.1:port; returns the runner to stop it."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def tracer_provider_from_env(service_name: str = "voice-agent"):
    """An OpenTelemetry tracer provider exporting over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or
    ..._TRACES_ENDPOINT) is set, else None. OTEL_EXPORTER_OTLP_PROTOCOL: `http/protobuf`
    (default) or `grpc`; OTEL_SERVICE_NAME overrides the service name."""
    if not any(
        os.environ.get(k)
        for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return None
    # the exporter of the protocol asked for, when tracing is on (CLI start-up time: grpc is slow)
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
