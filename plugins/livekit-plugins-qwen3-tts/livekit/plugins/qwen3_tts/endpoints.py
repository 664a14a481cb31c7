"""Health-aware choice among several TTS endpoints, with failover and recovery probing.

Endpoints are tried in the order given. One that fails is marked down and passed over while
another is healthy, until a background probe finds its `/ready` answering 200.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from livekit.agents import APIConnectionError

from .log import logger


@dataclass
class Endpoint:
    url: str
    healthy: bool = True
    down_since: float | None = None
    failed_at: float | None = None  # the last failure: the longest-failed one is tried first
    last_error: str | None = None
    failures: int = 0
    requests: int = 0


class EndpointPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, *, probe_interval: float = 2.0):
        if not urls:
            raise ValueError("at least one TTS base_url is required")
        self.endpoints = [Endpoint(u.rstrip("/")) for u in urls]
        self._client = client
        self.probe_interval = probe_interval
        self._prober: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # probes started in the background
        self._closed = False

    def __len__(self) -> int:
        return len(self.endpoints)

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]

    def choose(self, exclude: set[str] = frozenset()) -> Endpoint:
        """The first healthy endpoint not in `exclude`; if none is healthy, the one that failed
        longest ago (a request bounded by `conn_options.timeout` is as good a probe as any)."""
        candidates = [ep for ep in self.endpoints if ep.url not in exclude]
        if not candidates:
            errors = "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
            raise APIConnectionError(f"no Qwen3-TTS endpoint left to try ({errors})")
        for ep in candidates:
            if ep.healthy:
                return ep
        return min(candidates, key=lambda ep: ep.failed_at or 0.0)

    def mark_down(self, ep: Endpoint, reason: str) -> None:
        if ep.healthy:
            logger.warning("TTS endpoint %s is down: %s", ep.url, reason)
        ep.healthy = False
        ep.failed_at = time.monotonic()
        ep.down_since = ep.down_since or ep.failed_at
        ep.last_error = reason
        ep.failures += 1
        if not self._closed and (self._prober is None or self._prober.done()):
            self._prober = self._spawn(self._probe_loop())

    def prewarm(self) -> None:
        """Probe every endpoint in the background (a stalled probe ends at the client's timeout)."""
        if not self._closed:
            self._spawn(self.probe_all())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro, name="qwen3-tts-endpoint-probe")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def probe(self, ep: Endpoint) -> bool:
        try:
            r = await self._client.get(f"{ep.url}/ready")  # the client's own timeout
            ok = r.status_code == 200
        except httpx.HTTPError as e:
            ok, r = False, None
            ep.last_error = f"{type(e).__name__}: {e}"
        if ok and not ep.healthy:
            logger.info("TTS endpoint %s is back", ep.url)
            ep.healthy, ep.down_since = True, None
        elif not ok:
            ep.healthy = False
            if r is not None:
                ep.last_error = f"/ready answered {r.status_code}"
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(ep) for ep in self.endpoints))

    async def _probe_loop(self) -> None:
        while any(not e.healthy for e in self.endpoints):
            await asyncio.sleep(self.probe_interval)
            await asyncio.gather(*(self.probe(e) for e in self.endpoints if not e.healthy))

    async def aclose(self) -> None:
        """Stop probing: no probe task is left pending, and none is started afterwards."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
