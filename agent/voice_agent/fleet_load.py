"""The TTS fleet's share of the worker load: how much room the engines this worker uses have left.

LiveKit places a call on a worker by the load the worker reports (`load_fnc`, read every 0.5 s in
the worker's main process). The calls' TTS streams run in job processes, each with its own plugin
pool, so the main process looks at the engines itself: every `TTS_URL` entry, a host name that
resolves to several addresses counting once per address (as the plugin's discovery does), polled
on a daemon thread so `load_fnc` never waits on the network.

An engine that reports its real-time capacity (`"capacity"` in `/v1/engine/status`, the same
object as its `GET /load`) counts by its free slots: the fleet's load is `1 - free / slots` over
all of them, so a worker whose engines are all full reports 1.0 (full) and LiveKit steers new
calls to workers whose engines have room. Requests over TTS_QUEUE_CAPACITY on every engine also
make it full (an older engine without a capacity report counts by that alone); vLLM-Omni (no
status: 404) adds nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from livekit.plugins.qwen3_tts import EngineLoad
from livekit.plugins.qwen3_tts.discovery import Target

logger = logging.getLogger("voice_agent")
STALE_AFTER_S = 5.0  # no engine answered for this long: the fleet counts as saturated
SyncResolver = Callable[[str, int], Sequence[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """`getaddrinfo`'s addresses for `host` (IPv4 ones when there are any), as the plugin's."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    return [a for a in addresses if ":" not in a] or addresses


def engine_urls(urls: Sequence[str], resolve: SyncResolver = system_resolver) -> list[str]:
    """One URL per engine: a resolvable name is one per address; a name that does not resolve
    now is left as it is (its polls fail, and it counts as silent)."""
    out: list[str] = []
    for url in urls:
        target = Target.parse(url)
        if not target.resolvable:
            out.append(target.url)
            continue
        try:
            out += [target.at(a) for a in resolve(target.host, target.default_port)]
        except OSError as e:
            logger.debug("resolving %s: %s", target.host, e)
            out.append(target.url)
    return list(dict.fromkeys(out))


def engine_load(status: Mapping | None, capacity: int) -> float:
    """One engine's load (0..1) from its `/v1/engine/status` without a capacity report: requests
    waiting or in flight / `capacity`, or its memory pressure between the governor's watermarks
    (0 at `upgrade_at`, 1 at `critical_at`), whichever is larger."""
    load = EngineLoad.from_status(status)
    return min(1.0, max(0.0, load.queue_depth / max(1, capacity), load.memory_load()))


def fleet_load(statuses: Sequence[Mapping | None], capacity: int) -> float:
    """The fleet's load (0..1) from the engines' status bodies (None: no status): the larger of

    - slots: `1 - sum(free_slots) / sum(slots)` over the engines with a capacity report (an
      engine at its critical memory mark counting no free slots), and
    - queues: the least loaded engine by `engine_load` (requests over `capacity`, memory), so
      TTS_QUEUE_CAPACITY still bounds the requests on each engine.

    Either way the worker is full only when every engine it can use is."""
    loads = [engine_load(s, capacity) for s in statuses if s]
    by_queue = min(loads) if loads else 0.0
    reports = [(s, s["capacity"]) for s in statuses if s and isinstance(s.get("capacity"), Mapping)]
    if not reports:
        return by_queue
    free = sum(int(c.get("free_slots") or 0) for s, c in reports
               if EngineLoad.from_status(s).memory_load() < 1.0)  # fmt: skip
    slots = sum(max(1, int(c.get("slots") or 0)) for _, c in reports)
    return min(1.0, max(0.0, 1.0 - free / slots, by_queue))


class FleetPoller:
    """Polls `GET {engine}/v1/engine/status` of every engine behind `urls` every `interval`
    seconds (names re-resolved each round) and keeps the last answers."""

    def __init__(self, urls: Sequence[str], *, interval: float = 1.0, timeout: float = 2.0,
                 api_key: str | None = None, resolve: SyncResolver = system_resolver) -> None:  # fmt: skip
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        self.interval, self.timeout, self.resolve = interval, timeout, resolve
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.statuses: dict[str, dict] = {}  # engine URL -> last status, engines behind urls now
        self.unsupported: set[str] = set()  # engines that answer 404 (vLLM-Omni)
        self.rounds = 0  # polling rounds done (tests wait on it)
        self.last_ok: float | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tts-fleet-status", daemon=True)

    def start(self) -> FleetPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def load(self, capacity: int) -> float:
        return 1.0 if self.stale else fleet_load(list(self.statuses.values()), capacity)

    @property
    def stale(self) -> bool:
        """Nothing answered for STALE_AFTER_S (engines that have no status endpoint aside)."""
        if self.statuses.keys() == set() and self.unsupported:
            return False
        since = self.last_ok if self.last_ok is not None else self._started
        return time.monotonic() - since > STALE_AFTER_S

    def poll_once(self, client: httpx.Client) -> None:
        engines = engine_urls(self.urls, self.resolve)
        statuses: dict[str, dict] = {}
        for url in engines:
            try:
                r = client.get(
                    f"{url}/v1/engine/status", headers=self.headers, timeout=self.timeout
                )
            except httpx.HTTPError as e:
                logger.debug("engine status %s: %s", url, e)
                continue
            if r.status_code == 404:
                self.unsupported.add(url)
            elif r.status_code == 200:
                statuses[url] = r.json()
        self.statuses = statuses  # engines that vanished or went silent leave the fleet
        if statuses:
            self.last_ok = time.monotonic()
        self.rounds += 1

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                try:
                    self.poll_once(client)
                except Exception as e:  # a body that is not JSON, ...: keep polling
                    logger.warning("TTS fleet status: %s: %s", type(e).__name__, e)
                self._stop.wait(self.interval)
