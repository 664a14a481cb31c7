"""The engine server: one streaming HTTP protocol (OpenAI + vLLM-Omni fields) over handlers.

This module assembles it (auth and error middleware, start and stop; `ServerConfig` is
`server_config.py`). The routes: `speech.py` (`POST /v1/audio/speech`: s16le PCM, one HTTP chunk
per 4-frame audio chunk, as each is made), `speech_stream.py` (the engine's WebSocket) and
`qwen_realtime.py` (the hosted Qwen3-TTS realtime protocol's), `vllm_omni_stream.py` (vLLM-Omni's
dialect, on the engine's socket route without its subprotocol), the sockets on `socket_session.py`,
all adapters over `speech_service.py`; `operator.py` (`/health`, `/ready`, `/load`, `/get_load`,
`/v1/models`, `/v1/engine/*`, `/metrics`: for operators and load balancers).
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.governor.governor import Governor
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.protocol import (
    QWEN_REALTIME_PATH,
    SPEECH_STREAM_PATH,
    RequestError,
)
from qwen3_tts_engine.serving.auth import API, OPERATOR, PUBLIC, auth_middleware, exposure_problem
from qwen3_tts_engine.serving.errors import error_response
from qwen3_tts_engine.serving.metrics import Metrics
from qwen3_tts_engine.serving.operator import OperatorRoutes
from qwen3_tts_engine.serving.qwen_realtime import QwenRealtimeRoutes
from qwen3_tts_engine.serving.server_config import ServerConfig
from qwen3_tts_engine.serving.socket_session import SocketHub
from qwen3_tts_engine.serving.speech import SpeechRoutes
from qwen3_tts_engine.serving.speech_service import SpeechService
from qwen3_tts_engine.serving.speech_stream import SpeechStreamRoutes
from qwen3_tts_engine.serving.tracing import configure_from_env
from qwen3_tts_engine.serving.vllm_omni_stream import VllmOmniRoutes

# Who may call each route (auth.auth_middleware; a route not named needs the API key)
ROUTE_RULES = {
    "GET /health": PUBLIC, "GET /ready": PUBLIC, "GET /load": PUBLIC, "GET /metrics": PUBLIC,
    "GET /get_load": PUBLIC,  # vllm-router's shape of /load (operator.py)
    "POST /v1/audio/speech": API, f"GET {SPEECH_STREAM_PATH}": API, "GET /v1/models": API,
    f"GET {QWEN_REALTIME_PATH}": API,  # the hosted Qwen3-TTS realtime protocol (Bearer key)
    # (API: `Authorization: Bearer <key>` or `Api-Key <key>`, auth.py)
    "GET /v1/engine/status": API, "POST /v1/engine/variant": OPERATOR,
    "POST /v1/engine/fault": OPERATOR,
}  # fmt: skip


class InsecureServerError(ValueError):
    """The server would listen on a network address without an API key."""


class EngineServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 governor: Governor | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = Metrics()
        self.governor = governor
        auth = auth_middleware(
            ROUTE_RULES, self.config.api_key, self.config.operator_key, self._refused
        )
        self.app = web.Application(client_max_size=self.config.max_body_bytes,
                                   middlewares=[self._errors, auth])  # fmt: skip
        # the routes are adapters over one speech service; the operator's read the engine
        self.speech = SpeechService(engine, self.config, self.metrics)
        self.speech_routes = SpeechRoutes(self.speech)
        # the socket dialects share one hub: one session cap, one count for /load
        self.sockets = SocketHub(self.speech)
        self.stream_routes = SpeechStreamRoutes(self.sockets)
        self.omni_routes = VllmOmniRoutes(self.sockets)
        self.realtime_routes = QwenRealtimeRoutes(self.sockets)
        self.operator_routes = OperatorRoutes(engine, self.config, self.metrics, governor,
                                              sessions=self.sockets.session_counts)  # fmt: skip
        self.app.add_routes([*self.speech_routes.routes(), web.get(SPEECH_STREAM_PATH, self._speech_stream),
                             *self.realtime_routes.routes(), *self.operator_routes.routes()])  # fmt: skip
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind first (so /health answers while models load), then start the handlers.

        Raises `InsecureServerError` for a non-loopback host without an API key, unless
        `insecure_no_auth` says the operator means it (then a warning, on every start)."""
        problem = exposure_problem(self.config.host, self.config.api_key, self.config.operator_key)
        if problem and not self.config.insecure_no_auth:
            raise InsecureServerError(problem)
        if problem:
            logger.warning("serving %s WITHOUT an API key (--insecure-no-auth): anyone who can "
                           "reach it can synthesize and read its status", self.config.host)  # fmt: skip
        # handler_cancellation: a client that disconnects cancels its synthesis at once.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        await self.engine.start()
        if self.governor is not None:
            await self.governor.start()
        logger.info("engine server on http://%s:%d (model %s, variants %s)", self.config.host,
                    self.port, self.engine.model, ", ".join(self.engine.handlers))  # fmt: skip
        return self.port

    async def stop(self) -> None:
        if self.governor is not None:
            await self.governor.stop()
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _speech_stream(self, request: web.Request) -> web.StreamResponse:
        """The engine's socket route: its own protocol when the upgrade offers its subprotocol,
        vLLM-Omni's dialect otherwise."""
        if self.stream_routes.offered(request):
            return await self.stream_routes.stream(request)
        return await self.omni_routes.stream(request)

    # -- middleware and auth -----------------------------------------------------------------

    def _refused(self, why: RequestError) -> web.Response:
        """A request the auth middleware refused: its 401/403, counted by status."""
        self.metrics.requests.labels(str(why.status)).inc()
        return error_response(why)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400 and e.content_type != "application/json":
                err = RequestError(e.reason or "error", status=e.status)
                return web.json_response(err.to_json(), status=e.status)
            raise


async def serve_forever(server: EngineServer) -> None:
    """Run until SIGTERM/SIGINT, then stop the handlers (their workers exit). Traces go to the
    OTLP endpoint in the environment, if one is set (flushed at the end)."""
    provider = configure_from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
        if provider is not None:
            provider.shutdown()
