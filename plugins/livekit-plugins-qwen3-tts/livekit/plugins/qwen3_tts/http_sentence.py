"""One sentence over `POST /v1/audio/speech` on one endpoint: the HTTP transport of the failover
loop (`failover.py`), which retries it elsewhere with the same body (and so the same seed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from livekit.agents import APIConnectOptions, APIError, APIStatusError
from livekit.agents.telemetry import tracer
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from .endpoints import Endpoint, EndpointPool
from .failover import EngineFull
from .failures import EndpointUnavailable, Stalled
from .protocol import (
    BYTES_PER_SAMPLE,
    FRAME_SAMPLES,
    HEADER_CAPPED,
    HEADER_FINISH_REASON,
    HEADER_SAMPLE_RATE,
    HEADER_VARIANT,
    SAMPLE_RATE,
    error_message,
    finish_reason,
    rate_mismatch,
    retry_after_s,
)
from .replay import play_unheard


@dataclass
class SentenceReport:
    """What happened to one sentence: for logs, metrics and tests."""

    text: str
    delivered_bytes: int = 0
    endpoints: list[str] = field(default_factory=list)
    variant: str | None = None
    first_audio_s: float | None = None
    skipped_bytes: int = 0  # audio re-synthesized after a failover but not played again
    full: list[str] = field(default_factory=list)  # endpoints that answered 429 (engine full)
    seed: int | None = None  # sent with every attempt, so that a failover repeats the same audio
    first_chunk_frames: int | None = None  # the first chunk asked of the engine
    finish_reason: str | None = None  # why the engine ended it (`protocol.finish_reason`)

    @property
    def samples(self) -> int:
        return self.delivered_bytes // 2


class HttpSentenceAttempt:
    """`bodies[protocol]` (one sentence, its seed included, as the endpoint's protocol words it)
    to an endpoint; its PCM into `deliver`.

    `conn.timeout` bounds each try's connect and every wait for bytes; for a sentence requested
    ahead, the wait for its first byte counts from when `ahead` (the sentence queued before it)
    is done, since an engine synthesizes its requests one after another. `on_sent()` is called
    as the text goes to the model (LiveKit's TTFB starts there)."""

    def __init__(
        self, *, pool: EndpointPool, client: httpx.AsyncClient, headers: dict[str, str],
        bodies: dict[str, dict],
        report: SentenceReport, deliver: Callable[[bytes], None], on_sent: Callable[[], None],
        conn: APIConnectOptions, ahead: asyncio.Future | None = None,
    ) -> None:  # fmt: skip
        self._pool, self._client, self._headers, self._bodies = pool, client, headers, bodies
        self.report, self._deliver, self._on_sent = report, deliver, on_sent
        self._conn, self._ahead = conn, ahead
        self._t0 = time.perf_counter()  # first audio is counted from the sentence's first try
        self.what = repr(report.text[:40])

    async def run(self, ep: Endpoint) -> None:
        # A span in LiveKit's trace of the turn; the engine continues it (W3C traceparent).
        report = self.report
        attrs = {"qwen3_tts.endpoint": ep.url, "qwen3_tts.text_chars": len(report.text)}
        with tracer.start_as_current_span("qwen3_tts.request", kind=SpanKind.CLIENT,
                                          attributes=attrs) as span:  # fmt: skip
            headers = dict(self._headers)
            propagate.inject(headers)
            try:
                await self._request(ep, headers)
            finally:
                span.set_attributes({"qwen3_tts.variant": report.variant or "",
                                     "qwen3_tts.first_audio_s": report.first_audio_s or -1.0,
                                     "qwen3_tts.finish_reason": report.finish_reason or "",
                                     "qwen3_tts.delivered_bytes": report.delivered_bytes})  # fmt: skip

    async def _request(self, ep: Endpoint, headers: dict[str, str]) -> None:
        conn, report, body = self._conn, self.report, self._bodies[ep.protocol]
        self._on_sent()
        # Reads are timed here (not by httpx) so that a queued sentence's wait can be excused.
        timeout = httpx.Timeout(conn.timeout, read=None)
        request = self._client.build_request("POST", f"{ep.url}/v1/audio/speech", json=body,
                                             headers=headers, timeout=timeout)  # fmt: skip
        r = await self._open(request, conn.timeout)
        try:
            if r.status_code != 200:  # an error body is short; one that stalls is cut
                try:
                    async with asyncio.timeout(conn.timeout):
                        await r.aread()
                except TimeoutError:
                    raise Stalled(f"HTTP {r.status_code} with a body that stalled") from None
            if r.status_code == 429:  # full: its batch and queue; another engine may have room
                raise EngineFull(retry_after_s(r.headers.get("Retry-After")), r.text)
            if r.status_code >= 500:  # this engine is broken or busy; another may not be
                raise EndpointUnavailable(r.status_code, r.text)
            if r.status_code != 200:
                raise APIStatusError(_error_message(r), status_code=r.status_code,
                                     request_id=r.headers.get("x-request-id"), body=r.text)  # fmt: skip
            asked = body.get("sample_rate", SAMPLE_RATE)
            if why := rate_mismatch(asked, r.headers.get(HEADER_SAMPLE_RATE)):
                raise APIError(why, retryable=False)
            self._pool.mark_up(ep)
            report.variant = r.headers.get(HEADER_VARIANT)
            received = 0
            async with contextlib.aclosing(r.aiter_raw()) as chunks:
                while True:
                    try:
                        async with asyncio.timeout(conn.timeout):
                            data = await anext(chunks, None)
                    except TimeoutError:
                        stall = f"no audio for {conn.timeout:g} s after {received} bytes"
                        raise Stalled(stall) from None
                    if data is None:
                        break
                    play_unheard(report, data, received, self._t0, self._deliver)
                    received += len(data)
            capped = r.headers.get(HEADER_CAPPED) == "true" or _at_cap(body, received, asked)
            report.finish_reason = finish_reason(r.headers.get(HEADER_FINISH_REASON),
                                                 capped=capped)  # fmt: skip
        finally:
            await r.aclose()

    async def _open(self, request: httpx.Request, timeout: float) -> httpx.Response:
        """Send `request`; wait for the response head `timeout` s, counted once `ahead` is done."""
        send = asyncio.ensure_future(self._client.send(request, stream=True))
        try:
            if self._ahead is not None:
                await asyncio.wait({send, self._ahead}, return_when=asyncio.FIRST_COMPLETED)
            return await asyncio.wait_for(send, timeout)
        except TimeoutError:
            raise Stalled(f"no response for {timeout:g} s") from None
        except BaseException:
            send.cancel()
            await asyncio.wait({send})
            if not send.cancelled() and send.exception() is None:
                await send.result().aclose()
            raise


def _at_cap(body: dict, received: int, rate: int) -> bool:
    """The response holds `max_new_tokens` frames: it ran to the cap asked for (how an engine
    that names no finish reason on a streamed response is read)."""
    cap = body.get("max_new_tokens")
    frames = received / BYTES_PER_SAMPLE * SAMPLE_RATE / rate / FRAME_SAMPLES
    return cap is not None and round(frames) >= cap


def _error_message(r: httpx.Response) -> str:
    try:
        message = error_message(r.json())
    except ValueError:
        message = None
    return message or r.text[:300] or f"HTTP {r.status_code}"
