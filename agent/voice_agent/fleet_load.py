"""The TTS fleet's share of the worker load: how much room the engines this worker uses have left.

LiveKit places a call on a worker by the load the worker reports (`load_fnc`, read every 0.5 s in
the worker's main process). The calls' TTS streams run in job processes, each with its own plugin
pool, so the main process looks at the engines itself: every `TTS_URL` entry, a host name that
resolves to several addresses counting once per address (`fleet.Target`), each engine's public
`GET /load` polled on a daemon thread so `load_fnc` never waits on the network.

What the load means is the plugin's fleet contract (`livekit.plugins.qwen3_tts.fleet`): the share
of the engines' real-time slots taken, or the least loaded engine's streams over
`TTS_QUEUE_CAPACITY` (or its memory load), whichever is larger; so a worker whose engines are all
full reports 1.0 and LiveKit steers new calls to workers whose engines have room. An engine
without `/load` (vLLM-Omni: 404) adds nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import httpx

from livekit.plugins.qwen3_tts import fleet

logger = logging.getLogger("voice_agent")
STALE_AFTER_S = 5.0  # no engine answered for this long: the fleet counts as saturated


def engine_urls(
    urls: Sequence[str], resolve: fleet.SyncResolver = fleet.system_resolver_now
) -> list[str]:
    """One URL per engine: a resolvable name is one per address; a name that does not resolve
    now is left as it is (its polls fail, and it counts as silent)."""
    out: list[str] = []
    for url in urls:
        target = fleet.Target.parse(url)
        try:
            out += target.expand_now(resolve)
        except OSError as e:
            logger.debug("resolving %s: %s", target.host, e)
            out.append(target.url)
    return list(dict.fromkeys(out))


class FleetPoller:
    """Polls `GET {engine}/load` of every engine behind `urls` every `interval` seconds (names
    re-resolved each round) and keeps the last reports. `queue_capacity`: the agent's
    `tts_queue_capacity` setting."""

    def __init__(self, urls: Sequence[str], *, queue_capacity: int, interval: float = 1.0,
                 timeout: float = 2.0, resolve: fleet.SyncResolver = fleet.system_resolver_now) -> None:  # fmt: skip
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        self.queue_capacity = queue_capacity
        self.interval, self.timeout, self.resolve = interval, timeout, resolve
        self.loads: dict[
            str, fleet.Capacity
        ] = {}  # engine URL -> last report, engines behind urls now
        self.unsupported: set[str] = set()  # engines without /load (vLLM-Omni)
        self.rounds = 0  # polling rounds done (tests wait on it)
        self.last_ok: float | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tts-fleet-load", daemon=True)

    def start(self) -> FleetPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def load(self) -> float:
        if self.stale:
            return 1.0
        return fleet.fleet_load(list(self.loads.values()), self.queue_capacity)

    @property
    def stale(self) -> bool:
        """Nothing answered for STALE_AFTER_S (engines that have no /load aside)."""
        if not self.loads and self.unsupported:
            return False
        since = self.last_ok if self.last_ok is not None else self._started
        return time.monotonic() - since > STALE_AFTER_S

    def poll_once(self, client: httpx.Client) -> None:
        loads: dict[str, fleet.Capacity] = {}
        for url in engine_urls(self.urls, self.resolve):
            try:
                r = client.get(f"{url}{fleet.LOAD_PATH}", timeout=self.timeout)
            except httpx.HTTPError as e:
                logger.debug("engine load %s: %s", url, e)
                continue
            load = fleet.Capacity.from_json(r.json()) if r.status_code == 200 else None
            if load is not None:
                loads[url] = load
            elif r.status_code in (200, 404, 405):  # no such route, or a /load of another kind
                self.unsupported.add(url)
        self.loads = loads  # engines that vanished or went silent leave the fleet
        if loads:
            self.last_ok = time.monotonic()
        self.rounds += 1

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                try:
                    self.poll_once(client)
                except Exception as e:  # a body that is not JSON, ...: keep polling
                    logger.warning("TTS fleet load: %s: %s", type(e).__name__, e)
                self._stop.wait(self.interval)
