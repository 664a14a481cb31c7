"""An OpenTelemetry collector on loopback: OTLP/HTTP (protobuf) `POST /v1/traces`, the protocol
the SDK's exporter speaks, decoded with opentelemetry-proto and kept in memory for assertions."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPCollector:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:  # OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> OTLPCollector:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(
                        service=str(resource.get("service.name")), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    ))  # fmt: skip
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")  # fmt: skip

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def by_id(self) -> dict[str, Span]:
        return {s.span_id: s for s in self.spans}
