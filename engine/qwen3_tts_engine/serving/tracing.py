"""OpenTelemetry traces of speech requests, linked to the caller's trace by W3C `traceparent`.

A request that carries `traceparent` (the LiveKit plugin sends its span's) gets a server span
`qwen3_tts.speech` in that trace, with the handler's queue wait and first audio as attributes and
child spans. Export is configured by the standard `OTEL_EXPORTER_OTLP_*` variables and is off when
no endpoint is set (spans are then no-ops).
"""

from __future__ import annotations

import os

from opentelemetry import propagate, trace

tracer = trace.get_tracer("qwen3_tts_engine")
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def extract_context(headers):
    """The caller's trace context from request headers (an empty one without `traceparent`)."""
    return propagate.extract(headers)


def configure_from_env(service_name: str = "qwen3-tts-engine"):
    """A tracer provider exporting over OTLP when an endpoint is configured; None otherwise.

    OTEL_EXPORTER_OTLP_PROTOCOL chooses `http/protobuf` (default) or `grpc` (needs
    opentelemetry-exporter-otlp-proto-grpc, which the engine does not install); OTEL_SERVICE_NAME
    overrides the service name. Call `shutdown()` on the result to flush at exit.
    """
    if not any(os.environ.get(k) for k in ENDPOINT_ENV):
        return None
    # the SDK and an exporter only where tracing is configured (start-up time; gRPC is optional)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
        try:  # not a dependency: grpcio is large, and OTLP/HTTP reaches every collector
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-"
                               "otlp-proto-grpc installed; or use http/protobuf") from e  # fmt: skip
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider
