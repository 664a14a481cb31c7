"""The fleet contract, client side: an engine's `GET /load` (`Capacity`), the engines behind one
configured URL (`Target`), an engine's free slots and a fleet's load.

Public (exported from the package): the plugin's balancer (`balance.py`, `endpoints.py`) and an
agent's worker load (the voice agent's `fleet_load.py`) both call it, so "free" and "full" mean
one thing on both. The engine's `protocol.LoadReport` is the schema and its
`dispatch.engine.free_slots` the server's rule; tests/plugins/qwen3_tts/test_wire_contract.py
keeps this module in step with both, without the plugin importing the engine.

A `Target` whose host name resolves to several addresses (a Kubernetes headless Service, a
compose service with replicas) stands for one engine per address. A resolver is any
`(host, port) -> addresses` callable (async for `expand`, plain for `expand_now`); the defaults
ask the system's resolver (`getaddrinfo`), so a service registry or SRV records can stand in.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

LOAD_PATH = "/load"  # public (no key), answered from what the engine holds

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
SyncResolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True)
class Capacity:
    """An engine's `GET /load` (the engine's `protocol.LoadReport`; the fields a client weighs):
    streams running and waiting, the streams it keeps in real time now (`slots`), its state and
    its memory governor's load."""

    running: int
    waiting: int
    slots: int
    free_slots: int
    accepting: bool = True
    state: str = "serving"  # serving | swapping | draining | loading
    max_batch: int = 0
    server_load: int = 0  # running + waiting (vLLM's name)
    memory_pressure: float | None = None  # used fraction of the memory limit; None: no governor
    memory_load: float = 0.0  # 0 at or below the governor's upgrade mark, 1 at its critical mark

    @classmethod
    def from_json(cls, body: Any) -> Capacity | None:
        """None for a body that is not a load report (a server with another `/load`: vLLM's is
        `{"server_load": N}`)."""
        if not isinstance(body, Mapping):
            return None
        try:
            running, waiting = int(body["running"]), int(body["waiting"])
            pressure = body.get("memory_pressure")
            return cls(running=running, waiting=waiting, slots=int(body["slots"]),
                       free_slots=int(body["free_slots"]), accepting=bool(body.get("accepting", True)),
                       state=str(body.get("state", "serving")), max_batch=int(body.get("max_batch") or 0),
                       server_load=int(body.get("server_load", running + waiting)),
                       memory_pressure=None if pressure is None else float(pressure),
                       memory_load=float(body.get("memory_load") or 0.0))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def takes_new(self) -> bool:
        """Admits a new stream now: serving (not queueing it behind a swap, a drain or a load),
        with memory below the governor's critical mark."""
        return self.accepting and self.state == "serving" and self.memory_load < 1.0


def others(load: Capacity, mine_then: int) -> int:
    """The streams on an engine that are not this client's, as of its load report
    (`mine_then`: this client's requests in flight when the report arrived)."""
    return max(0, load.running + load.waiting - mine_then)


def free_slots(load: Capacity | None, others_then: int = 0, outstanding: int = 0) -> int | None:
    """An engine's free slots now: its reported slots less other clients' streams (as of the
    report, which goes stale between refreshes) and this client's (exact, counted by the
    caller); below 0 when overcommitted. None without a report. With `others_then` the report's
    own streams and nothing outstanding, it is the engine's `free_slots` (floored at 0)."""
    if load is None:
        return None
    if not load.takes_new:
        return 0
    return load.slots - others_then - outstanding


def fleet_load(loads: Sequence[Capacity], queue_capacity: int | None = None) -> float:
    """A fleet's load (0..1) from its engines' reports: the larger of

    - slots: the share taken, `1 - sum(free) / sum(slots)` (an engine that takes no new stream
      has none free), and
    - with `queue_capacity`: the least loaded engine's streams (running + waiting) over it, or its
      memory load if larger, so a bound on the requests per engine still applies.

    1.0 only when every engine is full; 0.0 for no report at all."""
    if not loads:
        return 0.0
    free = sum(max(0, free_slots(lo, others(lo, 0)) or 0) for lo in loads)
    slots = sum(max(1, lo.slots) for lo in loads)
    by_slots = 1.0 - free / slots
    by_queue = 0.0
    if queue_capacity is not None:
        by_queue = min(max(lo.server_load / max(1, queue_capacity), lo.memory_load) for lo in loads)
    return min(1.0, max(0.0, by_slots, by_queue))


# -- the engines behind one URL -------------------------------------------------------------------


def _addresses(infos: Sequence[tuple]) -> list[str]:
    """`getaddrinfo`'s addresses in its order, without repeats: IPv4 ones when there are any (a
    name such as localhost that also has ::1 would otherwise count an engine twice, once on an
    address it does not listen on), else IPv6."""
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    return [a for a in addresses if ":" not in a] or addresses


async def system_resolver(host: str, port: int) -> list[str]:
    """The system resolver's addresses for `host`, asked through asyncio's `getaddrinfo`."""
    loop = asyncio.get_running_loop()
    return _addresses(await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))


def system_resolver_now(host: str, port: int) -> list[str]:
    """The same, blocking (for a thread that polls the fleet)."""
    return _addresses(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))


@dataclass(frozen=True)
class Target:
    """One configured URL: one engine, or one per address of its host name."""

    url: str  # as configured, without a trailing slash
    scheme: str
    host: str
    port: int | None
    rest: str  # the path after host:port ("" or "/prefix")

    @classmethod
    def parse(cls, url: str) -> Target:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a TTS base_url must be an http:// or https:// URL, not {url!r}")
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"TTS base_url {url!r}: {e}") from None
        return cls(url, parts.scheme, parts.hostname, port, parts.path)

    @property
    def resolvable(self) -> bool:
        """A host name over plain HTTP. An address is itself; behind TLS the name must stay (the
        certificate is the name's), so an https:// URL is one endpoint."""
        if self.scheme != "http":
            return False
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False

    @property
    def default_port(self) -> int:
        return self.port or (443 if self.scheme == "https" else 80)

    def at(self, address: str) -> str:
        """The URL with `address` in place of the host name."""
        host = f"[{address}]" if ":" in address else address
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}://{host}{port}{self.rest}"

    async def expand(self, resolver: Resolver = system_resolver) -> list[str]:
        """The URLs of the engines behind this one now: itself unless `resolvable`, else one per
        address (none if the name has none). Raises what the resolver raises (`OSError`, ...)."""
        if not self.resolvable:
            return [self.url]
        return [self.at(str(a)) for a in await resolver(self.host, self.default_port)]

    def expand_now(self, resolver: SyncResolver = system_resolver_now) -> list[str]:
        """`expand`, blocking."""
        if not self.resolvable:
            return [self.url]
        return [self.at(str(a)) for a in resolver(self.host, self.default_port)]
