"""`voice-agent web`: the browser client (a page on LiveKit's JS client) and its token endpoint.

    GET  /                       the page (web/index.html)
    GET  /app.js, /style.css     its script and style
    GET  /livekit-client.umd.js  LiveKit's JS client, from web/node_modules (npm ci), never a CDN
    GET  /api/config             {"named_rooms": bool}: whether the page offers a room field
    POST /api/token              {} or {"room": name} -> {"url", "token", "room", "identity"}
    GET  /health                 "ok"

A token lets one visitor (a server-chosen identity) join one room and publish only a microphone,
for WEB_TOKEN_TTL seconds. By default the server picks the room, new and unguessable for each
visit, so nobody joins a call that is not theirs: a body naming a room gets 403. With
WEB_ALLOW_ROOM_NAMES a visitor may name one, but a room that already has a person in it (any
participant that is not an agent) gets 409 unless WEB_ALLOW_OCCUPIED_ROOMS; the LiveKit server is
asked, and when it cannot be the answer is 503, never a token. Each client address gets at most
WEB_TOKEN_RATE requests a minute (429 with Retry-After). The worker uses LiveKit's automatic
dispatch, so every new room gets an agent and the token carries no dispatch. The API secret only
signs tokens: it is in no response and not in the page.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import fields
from datetime import timedelta
from pathlib import Path

import aiohttp
from aiohttp import web
from livekit import api

from voice_agent.settings import WebSettings, problem

logger = logging.getLogger("voice_agent.web")
WEB_DIR = Path(__file__).resolve().parent / "web"
CLIENT_JS = WEB_DIR / "node_modules" / "livekit-client" / "dist" / "livekit-client.umd.js"
INSTALL_HINT = "npm ci --prefix agent/voice_agent/web  (or: bash scripts/install_browser.sh)"
ROOM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # what the page accepts, too
MAX_BODY = 4096
ROOM_PREFIX = "web-"  # + 20 hex digits (80 random bits): a room of the server's choosing
RATE_WINDOW = 60.0  # seconds: WEB_TOKEN_RATE counts the requests of the last minute
MAX_CLIENTS = 10_000  # addresses the rate limiter remembers at most
LIVEKIT_TIMEOUT = 5.0  # seconds for the room service's answer: then 503
# No inline scripts, nothing from other origins but the LiveKit server (any ws/wss/http/https
# origin: LiveKit URLs are configuration); media comes as MediaStreams, which CSP does not gate.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self' ws: wss: http: https:; media-src 'self' blob: mediastream:; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")  # fmt: skip
PAGES = {  # path -> (file, content type)
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
}


class ConfigError(ValueError):
    """A setting `voice-agent web` cannot run without."""


class RateLimiter:
    """At most `rate` requests per `window` seconds from one client, over a sliding window.

    Memory stays bounded: a client with no request left in the window is forgotten, and beyond
    `max_clients` the one that asked longest ago is (it gets a fresh allowance, never a refusal).
    `clock` is injectable so that tests need no waiting.
    """

    def __init__(self, rate: int, window: float = RATE_WINDOW, *, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.rate, self.window, self.max_clients, self.clock = rate, window, max_clients, clock
        self._hits: OrderedDict[str, deque[float]] = OrderedDict()  # oldest last request first

    def __len__(self) -> int:
        return len(self._hits)

    def hit(self, client: str) -> int:
        """Count a request of `client`: 0 when allowed, else the whole seconds (>= 1) until one
        would be (a refused request is not counted)."""
        if self.rate <= 0:
            return 0
        now = self.clock()
        while self._hits:  # the front asked longest ago: drop it while it is stale
            first = next(iter(self._hits.values()))
            if first[-1] > now - self.window:
                break
            self._hits.popitem(last=False)
        hits = self._hits.get(client) or deque()
        while hits and hits[0] <= now - self.window:
            hits.popleft()
        if len(hits) >= self.rate:
            return max(1, math.ceil(hits[0] + self.window - now))
        hits.append(now)
        self._hits[client] = hits
        self._hits.move_to_end(client)
        while len(self._hits) > self.max_clients:
            self._hits.popitem(last=False)
        return 0


def people(participants: Iterable[api.ParticipantInfo]) -> list[str]:
    """Identities of the participants that are not agents: browsers, phones (SIP), ingress..."""
    return [p.identity for p in participants if p.kind != api.ParticipantInfo.Kind.AGENT]


def check_settings(settings: WebSettings) -> None:
    missing = [env for env, value in (("LIVEKIT_URL", settings.livekit_url),
                                      ("LIVEKIT_API_KEY", settings.livekit_api_key),
                                      ("LIVEKIT_API_SECRET", settings.livekit_api_secret)) if not value]  # fmt: skip
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: the token endpoint needs the LiveKit "
                          "server's URL and an API key pair (environment or .env; see docs/agent.md)")  # fmt: skip
    url = settings.web_livekit_url or settings.livekit_url
    if not re.match(r"(wss?|https?)://[^/\s]+", url or ""):
        raise ConfigError(f"LiveKit URL for the browser {url!r} is not a ws://, wss://, http:// "
                          "or https:// URL")  # fmt: skip
    if settings.web_token_ttl <= 0:
        raise ConfigError(f"WEB_TOKEN_TTL must be positive, got {settings.web_token_ttl}")
    if not 0 < settings.web_port < 65536:
        raise ConfigError(f"WEB_PORT must be a port number (1-65535), got {settings.web_port}")
    for f in fields(settings):  # the fields' own checks, for settings not built by `load()`
        if (wrong := problem(f, getattr(settings, f.name))) is not None:
            raise ConfigError(f"{f.metadata['env']}: {wrong}")


def client_js_path(settings: WebSettings) -> Path:
    return Path(settings.web_client_js).expanduser() if settings.web_client_js else CLIENT_JS


def make_token(settings: WebSettings, room: str, identity: str) -> str:
    """A join token for one room and one identity: publish a microphone, subscribe, data."""
    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True,
                             can_publish_data=True, can_publish_sources=["microphone"])  # fmt: skip
    return (api.AccessToken(settings.livekit_api_key, settings.livekit_api_secret)
            .with_identity(identity).with_name("Web visitor").with_grants(grants)
            .with_ttl(timedelta(seconds=settings.web_token_ttl)).to_jwt())  # fmt: skip


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status,
                             headers={"Cache-Control": "no-store", **(headers or {})})  # fmt: skip


def _unavailable(room: str, e: BaseException) -> web.Response:
    logger.warning("cannot ask the LiveKit server who is in room %s: %r", room, e)
    return _error(503, "the LiveKit server could not be asked whether this room is free, so no "
                  "token was given: try again later")  # fmt: skip


def parse_room(body: object) -> str | None:
    """The requested room name (None: pick one); ValueError with the reason if it is invalid."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object, e.g. {"room": "my-room"}')
    unknown = set(body) - {"room"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    room = body.get("room")
    if room is None or room == "":
        return None
    if not isinstance(room, str) or not ROOM_NAME.fullmatch(room):
        raise ValueError("room must be 1-64 characters: letters, digits, '_', '-', '.', starting "
                         "with a letter or digit")  # fmt: skip
    return room


LIVEKIT_API = web.AppKey("livekit_api", api.LiveKitAPI)


def create_app(
    settings: WebSettings, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """The web server's app; `clock` (seconds) drives the rate limiter."""
    check_settings(settings)
    browser_url = settings.web_livekit_url or settings.livekit_url
    js_path = client_js_path(settings)
    limiter = RateLimiter(settings.web_token_rate, clock=clock)
    check_occupancy = settings.web_allow_room_names and not settings.web_allow_occupied_rooms

    async def page(request: web.Request) -> web.Response:
        name, ctype = PAGES[request.path]
        return web.Response(body=(WEB_DIR / name).read_bytes(), content_type=ctype,
                            charset="utf-8", headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def client_js(request: web.Request) -> web.StreamResponse:
        if not js_path.is_file():
            logger.error("%s is missing: %s", js_path, INSTALL_HINT)
            return web.Response(status=500, content_type="text/plain", text=(
                f"livekit-client is not installed ({js_path} is missing).\n"
                f"Install it with: {INSTALL_HINT}\n"))  # fmt: skip
        return web.FileResponse(js_path, headers={"Content-Type": "text/javascript",
                                                  "Cache-Control": "no-cache"})  # fmt: skip

    async def config(request: web.Request) -> web.Response:
        return web.json_response({"named_rooms": settings.web_allow_room_names},
                                 headers={"Cache-Control": "no-store"})  # fmt: skip

    async def refusal(request: web.Request, room: str) -> web.Response | None:
        """Why `room`, named by the visitor, is not granted (None: it is)."""
        if not settings.web_allow_room_names:
            logger.info("refused a named room for %s (WEB_ALLOW_ROOM_NAMES is off)", request.remote)
            return _error(403, "this server picks the room for each visit: send no \"room\" "
                          "(naming one needs WEB_ALLOW_ROOM_NAMES=1 on the server)")  # fmt: skip
        if not check_occupancy:
            return None
        try:
            listed = await request.app[LIVEKIT_API].room.list_participants(
                api.ListParticipantsRequest(room=room)
            )
            participants = list(listed.participants)
        except api.ServerError as e:
            if e.code != api.ServerErrorCode.NOT_FOUND:  # not found: no room yet, nobody in it
                return _unavailable(room, e)
            participants = []
        except (aiohttp.ClientError, TimeoutError) as e:
            return _unavailable(room, e)
        if people(participants):
            logger.info("refused occupied room %s for %s", room, request.remote)
            return _error(409, f"room {room!r} already has someone in it: choose another name "
                          "(joining occupied rooms needs WEB_ALLOW_OCCUPIED_ROOMS=1 on the server)")  # fmt: skip
        return None

    async def token(request: web.Request) -> web.Response:
        if wait := limiter.hit(request.remote or "unknown"):
            return _error(429, f"too many token requests from this address (at most "
                          f"{settings.web_token_rate} a minute, WEB_TOKEN_RATE): try again in "
                          f"{wait} s", headers={"Retry-After": str(wait)})  # fmt: skip
        if request.content_length and request.content_length > MAX_BODY:
            return _error(413, f"body over {MAX_BODY} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over {MAX_BODY} bytes")
        try:
            body = json.loads(raw) if raw.strip() else None
            room = parse_room(body)
        except json.JSONDecodeError:
            return _error(400, "the body is not JSON")
        except ValueError as e:
            return _error(400, str(e))
        if room is not None and (refused := await refusal(request, room)) is not None:
            return refused
        room = room or f"{ROOM_PREFIX}{secrets.token_hex(10)}"
        identity = f"web-{secrets.token_hex(6)}"
        logger.info("token for %s in room %s", identity, room)
        return web.json_response(
            {"url": browser_url, "token": make_token(settings, room, identity), "room": room,
             "identity": identity}, headers={"Cache-Control": "no-store"})  # fmt: skip

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def headers(request: web.Request, handler) -> web.StreamResponse:
        resp = await handler(request)
        resp.headers.setdefault("Content-Security-Policy", CSP)
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        return resp

    async def livekit_api(app: web.Application):
        """One room-service client for the app's life, closed with it."""
        app[LIVEKIT_API] = api.LiveKitAPI(settings.livekit_url, settings.livekit_api_key,
                                          settings.livekit_api_secret,
                                          timeout=aiohttp.ClientTimeout(total=LIVEKIT_TIMEOUT))  # fmt: skip
        try:
            yield
        finally:
            await app[LIVEKIT_API].aclose()

    app = web.Application(client_max_size=MAX_BODY, middlewares=[headers])
    if check_occupancy:
        app.cleanup_ctx.append(livekit_api)
    for path in PAGES:
        app.router.add_get(path, page)
    app.router.add_get("/livekit-client.umd.js", client_js)
    app.router.add_get("/api/config", config)
    app.router.add_post("/api/token", token)
    app.router.add_get("/health", health)
    return app


def run_web(settings: WebSettings) -> int:
    """`voice-agent web`: serve until interrupted; 1 with a message for a missing setting."""
    try:
        app = create_app(settings)
    except ConfigError as e:
        print(f"voice-agent web: error: {e}", file=sys.stderr)
        return 1
    js_path = client_js_path(settings)
    if not js_path.is_file():
        print(f"voice-agent web: WARNING: {js_path} is missing, the page cannot connect until "
              f"it is installed: {INSTALL_HINT}", file=sys.stderr)  # fmt: skip
    host = settings.web_host
    shown = f"[{host}]" if ":" in host else host
    ready = (f"voice-agent web: serving http://{shown}:{settings.web_port}/ (tokens for "
             f"{settings.web_livekit_url or settings.livekit_url})")  # fmt: skip
    try:  # aiohttp calls `print` once it listens
        web.run_app(app, host=host, port=settings.web_port, print=lambda _: print(ready, flush=True),
                    handle_signals=True, access_log=None)  # fmt: skip
    except OSError as e:  # port in use, address not available
        print(f"voice-agent web: error: cannot listen on {host}:{settings.web_port}: {e}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
