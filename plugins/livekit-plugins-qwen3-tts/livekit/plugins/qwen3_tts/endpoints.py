"""The engines a TTS talks to: their health, their load, and the choice of one per request.

Each configured URL is one endpoint, or one per address when its host name resolves to several
(`fleet.Target`; re-resolved every `resolve_interval` s: new addresses are used, vanished ones
dropped once their requests end). A request goes to the endpoint `balance.pick` chooses among the
healthy ones: by load (`balanced`, the default) or in configured order (`priority`). An endpoint
that fails is marked down and passed over until its `/ready` answers 200; one that answers 429
(full) is passed over for its `Retry-After`, without being marked down.

Background work runs only while the pool is in use (`in_use()`: a stream of the TTS is open):
probes of down endpoints every `probe_interval` s, `GET /load` of each healthy endpoint every
`load_interval` s (only where there is a choice to make), and re-resolution. When the last stream
ends it stops, so no task of the pool outlives the work that needs it.
Whether an endpoint takes streamed text is read once from its status and kept until it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from livekit.agents import APIConnectionError

from . import balance
from .fleet import LOAD_PATH, Capacity, Resolver, Target, free_slots, others, system_resolver
from .log import logger
from .models import Strategy
from .protocol import STATUS_PATH, streams_text

STRATEGIES = ("balanced", "priority")
RESOLVE_TIMEOUT_S = 5.0  # a resolver that takes longer counts as failed (the known set stays)


@dataclass
class Endpoint:
    url: str
    source: str | None = None  # the configured URL whose name resolved to this address
    healthy: bool = True
    down_since: float | None = None
    failed_at: float | None = None  # the last failure: the longest-failed one is tried first
    last_error: str | None = None
    failures: int = 0
    requests: int = 0
    outstanding: int = 0  # this client's requests in flight here
    rejections: int = 0  # 429 answers
    busy_until: float = 0.0  # after a 429: passed over until then (its Retry-After)
    load: Capacity | None = None  # the last `GET /load` (None: none, or no such endpoint)
    others: int = 0  # streams of other clients on the engine, as of `load`
    load_at: float | None = None
    load_supported: bool = True  # False once /load answered 404 (an older engine, vLLM-Omni)
    retired: bool = False  # its address vanished from its name: no new requests
    probed_at: float = 0.0
    streaming_text: bool | None = None  # from its status; None: not read since it last failed
    protocol: str = "qwen3-tts"  # the dialect it speaks: the engine's own, or "vllm-omni"

    def free(self) -> int | None:
        """Estimated free slots now (None: the engine does not report its load)."""
        return free_slots(self.load, self.others, self.outstanding)


@dataclass
class _Source:
    target: Target
    protocol: str = "qwen3-tts"  # of every endpoint behind it
    endpoints: list[Endpoint] = field(default_factory=list)
    resolved_at: float | None = None  # None: never resolved (or not a name)


class EndpointPool:
    def __init__(
        self, urls: list[str], client: httpx.AsyncClient, *, strategy: Strategy = "balanced",
        probe_interval: float = 2.0, load_interval: float = 0.5, resolve_interval: float = 10.0,
        resolver: Resolver | None = None, rng: random.Random | None = None,
        headers: dict[str, str] | None = None, protocols: list[str] | None = None,
    ) -> None:  # fmt: skip
        if not urls:
            raise ValueError("at least one TTS base_url is required")
        protocols = protocols or ["qwen3-tts"] * len(urls)
        if len(protocols) != len(urls):
            raise ValueError(f"{len(protocols)} protocols for {len(urls)} base URLs: give one "
                             "protocol, or one per URL")  # fmt: skip
        check_strategy(strategy)
        for name, value in (("probe_interval", probe_interval), ("load_interval", load_interval),
                            ("resolve_interval", resolve_interval)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, not {value!r}")
        self._sources = [_Source(Target.parse(u), p) for u, p in zip(urls, protocols, strict=True)]
        for src in self._sources:
            if not src.target.resolvable:  # an address (or https): itself, from the start
                src.endpoints = [Endpoint(src.target.url, protocol=src.protocol)]
        self.endpoints: list[Endpoint] = []
        self._rebuild()
        self._client = client
        self.strategy: Strategy = strategy
        self.probe_interval, self.load_interval = probe_interval, load_interval
        self.resolve_interval = resolve_interval
        self._resolver = resolver or system_resolver
        self._rng = rng or random.Random()
        self._users = 0
        self._keeper: asyncio.Task | None = None
        self._jobs: dict[tuple[str, str], asyncio.Task] = {}  # (kind, url) -> its running task
        self._warm: asyncio.Task | None = None  # the first resolution and load round
        self._tasks: set[asyncio.Task] = set()  # every task started here
        self._headers = headers or {}  # the engine's auth, for its status
        self._closed = False

    def __len__(self) -> int:
        return len(self.live())

    def live(self) -> list[Endpoint]:
        return [e for e in self.endpoints if not e.retired]

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.live() if e.healthy]

    def untried(self, tried: Iterable[str]) -> bool:
        tried = set(tried)
        return any(e.url not in tried for e in self.live())

    # -- the choice --------------------------------------------------------------------------

    def choose(self, exclude: Iterable[str] = frozenset()) -> Endpoint:
        """The endpoint for the next request, `exclude` (URLs) aside: among the healthy ones not
        waiting out a 429, by `strategy`; if none, one waiting out a 429 (the soonest free); if
        none is healthy, the one that failed longest ago (a request bounded by
        `conn_options.timeout` is as good a probe as any)."""
        exclude = set(exclude)
        candidates = [ep for ep in self.live() if ep.url not in exclude]
        if not candidates:
            errors = "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
            raise APIConnectionError(f"no Qwen3-TTS endpoint left to try ({errors})")
        now = time.monotonic()
        usable = [ep for ep in candidates if ep.healthy and ep.busy_until <= now]
        if usable:
            order = {id(ep): i for i, ep in enumerate(self.endpoints)}
            snapshot = [balance.Candidate(order[id(ep)], ep.outstanding, ep.free(),
                                          ep.load.slots if ep.load else None) for ep in usable]  # fmt: skip
            chosen = balance.pick(snapshot, self.strategy, self._rng)
            return next(ep for ep in usable if order[id(ep)] == chosen.order)
        busy = [ep for ep in candidates if ep.healthy]
        if busy:
            return min(busy, key=lambda ep: ep.busy_until)
        return min(candidates, key=lambda ep: ep.failed_at or 0.0)

    async def acquire(self, exclude: Iterable[str] = frozenset()) -> Endpoint:
        """`choose`, once names are resolved and (with a choice to make) every engine's load was
        read once; the endpoint counts one more outstanding request until `release`."""
        if self._warm is None or self._warm.cancelled():
            if not self._closed:
                self._warm = self._spawn(self._warm_up(), "warm-up")
        if self._warm is not None:
            await asyncio.shield(self._warm)
        ep = self.choose(exclude)
        ep.outstanding += 1
        ep.requests += 1
        return ep

    def release(self, ep: Endpoint) -> None:
        ep.outstanding -= 1
        if ep.retired and ep.outstanding <= 0:
            self._rebuild()

    # -- what requests report ----------------------------------------------------------------

    def mark_down(self, ep: Endpoint, reason: str) -> None:
        if ep.healthy:
            logger.warning("TTS endpoint %s is down: %s", ep.url, reason)
        ep.healthy = False
        ep.failed_at = ep.probed_at = time.monotonic()
        ep.down_since = ep.down_since or ep.failed_at
        ep.last_error = reason
        ep.failures += 1
        ep.load = None  # unknown until it is back and reports again
        ep.streaming_text = None  # what comes back may be another engine

    def mark_up(self, ep: Endpoint) -> None:
        """A request was answered: the endpoint works, whatever a probe said before."""
        if not ep.healthy:
            logger.info("TTS endpoint %s is back", ep.url)
            ep.healthy, ep.down_since = True, None

    def mark_full(self, ep: Endpoint, retry_after: float) -> None:
        """A 429: the engine is full, not broken. Passed over for `retry_after` seconds."""
        ep.rejections += 1
        ep.busy_until = time.monotonic() + retry_after
        if ep.load is not None:  # by its answer it has no free slot now, whatever it said before
            ep.others = max(ep.others, ep.load.slots - ep.outstanding + 1)

    # -- background work ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def in_use(self) -> AsyncIterator[None]:
        """Held by each stream while it runs: the pool keeps its view of the engines fresh while
        anything holds it, and stops every background task when the last holder lets go."""
        self._users += 1
        if self._keeper is None and not self._closed:
            self._keeper = self._spawn(self._keep(), "keeper")
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0:
                await self._stop_background()

    async def streams_text(self, ep: Endpoint, timeout: float) -> bool:
        """Whether `ep` takes streamed text (`"streaming_text": true` in its status), read once.
        A 200 without it, or no such route (vLLM-Omni's 404), is kept as no; another answer
        (401, 503) is a no for now, read again next time. A transport error or `timeout` raises
        httpx's error, as a request would, for the caller to fail over."""
        if ep.streaming_text is not None:
            return ep.streaming_text
        r = await self._client.get(f"{ep.url}{STATUS_PATH}", headers=self._headers, timeout=timeout)
        try:
            body = r.json() if r.status_code == 200 else None
        except ValueError:
            body = None
        if r.status_code in (200, 404, 405):
            ep.streaming_text = streams_text(body)
        return streams_text(body)

    def prewarm(self) -> None:
        """Resolve names, probe every endpoint, read its load and whether it takes streamed
        text, in the background (each request ends at the client's timeout)."""
        if not self._closed:
            self._spawn(self._prewarm(), "probe")

    async def _prewarm(self) -> None:
        await self._resolve_due(force=True)
        await asyncio.gather(*(self.probe(ep) for ep in self.live()))
        await self._read_status()
        if self._balancing():
            await asyncio.gather(*(self.refresh_load(ep) for ep in self.healthy()))

    async def probe(self, ep: Endpoint) -> bool:
        ep.probed_at = time.monotonic()
        try:
            r = await self._client.get(f"{ep.url}/ready")  # the client's own timeout
            ok = r.status_code == 200
        except httpx.HTTPError as e:
            ok, r = False, None
            ep.last_error = f"{type(e).__name__}: {e}"
        if ok:
            self.mark_up(ep)
        else:
            ep.healthy = False
            if r is not None:
                ep.last_error = f"/ready answered {r.status_code}"
        return ok

    async def probe_all(self, *, read_status: bool = False) -> None:
        await asyncio.gather(*(self.probe(ep) for ep in self.live()))
        if read_status:
            await self._read_status()

    async def _read_status(self) -> None:
        timeout = self._client.timeout.read or 2.0
        # (a vLLM-Omni endpoint has no status: its upgrade says whether it takes streamed text)
        await asyncio.gather(*(self.streams_text(ep, timeout) for ep in self.healthy()
                               if ep.protocol == "qwen3-tts"), return_exceptions=True)  # fmt: skip

    async def refresh_load(self, ep: Endpoint) -> None:
        """`GET /load`: the engine's slots and streams. Not a health check: a failure only makes
        the load unknown (a request, or the recovery probe, decides about health)."""
        try:
            r = await self._client.get(f"{ep.url}{LOAD_PATH}")
        except httpx.HTTPError:
            ep.load = None
            return
        ep.load_at = time.monotonic()
        if r.status_code in (404, 405):
            ep.load, ep.load_supported = None, False
            logger.info("TTS endpoint %s has no /load: balanced by requests in flight", ep.url)
            return
        try:
            load = Capacity.from_json(r.json()) if r.status_code == 200 else None
        except ValueError:
            load = None
        if load is None:
            ep.load_supported = r.status_code != 200  # a /load of another kind: stop asking
        ep.load = load
        if load is not None:
            ep.others = others(load, ep.outstanding)

    async def resolve(self) -> None:
        """Resolve every name now (new addresses join, vanished ones retire)."""
        await self._resolve_due(force=True)

    async def _resolve_due(self, *, force: bool = False) -> None:
        now = time.monotonic()
        due = [s for s in self._sources if s.target.resolvable
               and (force or s.resolved_at is None or now - s.resolved_at >= self.resolve_interval)]  # fmt: skip
        await asyncio.gather(*(self._resolve(s) for s in due))

    async def _resolve(self, src: _Source) -> None:
        target = src.target
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                urls = await target.expand(self._resolver)
        except Exception as e:  # socket.gaierror, a timeout, or whatever a custom resolver raises
            urls = []
            reason = f"{type(e).__name__}: {e}"
        else:
            reason = "no address"
        src.resolved_at = time.monotonic()
        if not urls:
            if not src.endpoints:  # never resolved: the name itself (a request will say why)
                logger.warning("TTS endpoint %s: cannot resolve %s (%s)", target.url, target.host,
                               reason)  # fmt: skip
                src.endpoints = [Endpoint(target.url, source=target.url, protocol=src.protocol)]
                self._rebuild()
            return  # a failed re-resolution keeps the engines it knew
        known = {ep.url: ep for ep in src.endpoints}
        for ep in src.endpoints:
            gone = ep.url not in urls
            if gone and not ep.retired and ep.url != target.url:
                logger.info("TTS endpoint %s left %s", ep.url, target.host)
            ep.retired = gone
        for url in urls:
            if url not in known:
                logger.info("TTS endpoint %s joined (%s)", url, target.host)
                src.endpoints.append(Endpoint(url, source=target.url, protocol=src.protocol))
        self._rebuild()

    def _rebuild(self) -> None:
        """`endpoints`: every source's, in configured order; a retired one stays only while it
        still has requests in flight."""
        for src in self._sources:
            src.endpoints = [ep for ep in src.endpoints if not (ep.retired and ep.outstanding <= 0)]
        self.endpoints = [ep for src in self._sources for ep in src.endpoints]

    def _balancing(self) -> bool:
        return self.strategy == "balanced" and len(self.live()) > 1

    async def _warm_up(self) -> None:
        try:
            await self._resolve_due()
            if self._balancing():
                await asyncio.gather(*(self.refresh_load(ep) for ep in self.healthy()
                                       if ep.load_at is None and ep.load_supported))  # fmt: skip
        except Exception:  # never in the way of a request: it chooses on what is known
            logger.exception("TTS endpoint pool: warming up failed")

    async def _keep(self) -> None:
        """While the pool is in use: start each due job (one at a time per kind and endpoint)."""
        while True:
            now = time.monotonic()
            if any(s.target.resolvable for s in self._sources):
                self._job("resolve", "", self._resolve_due)
            for ep in self.live():
                if not ep.healthy:
                    if now - ep.probed_at >= self.probe_interval:
                        self._job("probe", ep.url, lambda ep=ep: self.probe(ep))
                elif self._balancing() and ep.load_supported and (
                        ep.load_at is None or now - ep.load_at >= self.load_interval):  # fmt: skip
                    self._job("load", ep.url, lambda ep=ep: self.refresh_load(ep))
            await asyncio.sleep(min(self.load_interval, self.probe_interval, self.resolve_interval))

    def _job(self, kind: str, key: str, make) -> None:
        running = self._jobs.get((kind, key))
        if running is None or running.done():
            self._jobs[(kind, key)] = self._spawn(make(), kind)

    def _spawn(self, coro: Coroutine[Any, Any, Any], kind: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"qwen3-tts-endpoint-{kind}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stop_background(self) -> None:
        """Stop the keeper and what it started (prewarm probes run on: they end by themselves)."""
        tasks = [t for t in (self._keeper, self._warm, *self._jobs.values()) if t is not None]
        self._keeper, self._jobs = None, {}
        if self._warm is not None and not self._warm.done():
            self._warm = None  # the next user warms up again
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Stop everything: no task of the pool is left pending, and none is started afterwards."""
        self._closed = True
        await self._stop_background()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
