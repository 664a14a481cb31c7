"""Per-turn metrics: one log line per turn, Prometheus histograms, and a `/health` endpoint.

LiveKit puts each turn's latencies on `ChatMessage.metrics`; `TurnMetrics` collects them from a
session's `conversation_item_added` events.
"""

from __future__ import annotations

import logging

from aiohttp import web
from livekit.agents import AgentSession, llm
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Histogram, generate_latest

logger = logging.getLogger("voice_agent")
_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2, 3, 5, 10, 30)
# (ChatMessage.metrics key, role of the message that carries it)
TURN_METRICS = {
    "end_of_turn_delay": "user", "transcription_delay": "user", "llm_node_ttft": "assistant",
    "tts_node_ttfb": "assistant", "e2e_latency": "assistant",
}  # fmt: skip
_HISTOGRAMS = {
    name: Histogram(f"voice_agent_{name}_seconds", f"Per-turn {name} (LiveKit metrics)",
                    buckets=_BUCKETS)  # fmt: skip
    for name in TURN_METRICS
}


class TurnMetrics:
    def __init__(self, session: AgentSession) -> None:
        self._user: dict = {}
        session.on("conversation_item_added", lambda ev: self.observe(ev.item))

    def observe(self, item) -> None:
        if not isinstance(item, llm.ChatMessage):
            return
        values = {k: v for k, v in item.metrics.items() if k in TURN_METRICS and TURN_METRICS[k] == item.role}
        for k, v in values.items():
            if isinstance(v, int | float):
                _HISTOGRAMS[k].observe(v)
        if item.role == "user":
            self._user = values
        elif item.role == "assistant":
            turn = {**self._user, **values}
            self._user = {}
            logger.info("turn: %s", " ".join(f"{k}={v:.3f}s" for k, v in turn.items()
                                                 if isinstance(v, int | float)))  # fmt: skip


async def start_metrics_server(port: int) -> web.AppRunner:
    """`/metrics` (Prometheus) and `/health` on 127.0.0.1:port; returns the runner to stop it."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner
