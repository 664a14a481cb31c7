"""`voice-agent web`: the browser client (a page on LiveKit's JS client) and its token endpoint.

    GET  /                       the page (web/index.html)
    GET  /app.js, /style.css     its script and style
    GET  /livekit-client.umd.js  LiveKit's JS client, from web/node_modules (npm ci), never a CDN
    POST /api/token              {"room": optional} -> {"url", "token", "room", "identity"}
    GET  /health                 "ok"

A token lets one visitor (random identity) join one room (given, or random) and publish only a
microphone. The worker uses LiveKit's automatic dispatch (`@server.rtc_session()` without an
agent name), so every new room gets an agent and the token carries no dispatch. The API secret
only signs tokens: it is in no response and not in the page.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
from datetime import timedelta
from pathlib import Path

from aiohttp import web
from livekit import api

from .settings import WebSettings

logger = logging.getLogger("voice_agent.web")
WEB_DIR = Path(__file__).resolve().parent / "web"
CLIENT_JS = WEB_DIR / "node_modules" / "livekit-client" / "dist" / "livekit-client.umd.js"
INSTALL_HINT = "npm ci --prefix agent/voice_agent/web  (or: bash scripts/install_browser.sh)"
ROOM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # what the page accepts, too
MAX_BODY = 4096
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


def check_settings(settings: WebSettings) -> None:
    missing = [env for env, value in (("LIVEKIT_URL", settings.livekit_url),
                                      ("LIVEKIT_API_KEY", settings.livekit_api_key),
                                      ("LIVEKIT_API_SECRET", settings.livekit_api_secret)) if not value]  # fmt: skip
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: the token endpoint needs the LiveKit "
                          "server's URL and an API key pair (environment or .env; see the README)")  # fmt: skip
    url = settings.web_livekit_url or settings.livekit_url
    if not re.match(r"(wss?|https?)://[^/\s]+", url or ""):
        raise ConfigError(f"LiveKit URL for the browser {url!r} is not a ws://, wss://, http:// "
                          "or https:// URL")  # fmt: skip
    if settings.web_token_ttl <= 0:
        raise ConfigError(f"WEB_TOKEN_TTL must be positive, got {settings.web_token_ttl}")
    if not 0 < settings.web_port < 65536:
        raise ConfigError(f"WEB_PORT must be a port number (1-65535), got {settings.web_port}")


def client_js_path(settings: WebSettings) -> Path:
    return Path(settings.web_client_js).expanduser() if settings.web_client_js else CLIENT_JS


def make_token(settings: WebSettings, room: str, identity: str) -> str:
    """A join token for one room and one identity: publish a microphone, subscribe, data."""
    grants = api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True,
                             can_publish_data=True, can_publish_sources=["microphone"])  # fmt: skip
    return (api.AccessToken(settings.livekit_api_key, settings.livekit_api_secret)
            .with_identity(identity).with_name("Web visitor").with_grants(grants)
            .with_ttl(timedelta(seconds=settings.web_token_ttl)).to_jwt())  # fmt: skip


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status,
                             headers={"Cache-Control": "no-store"})  # fmt: skip


def parse_room(body: object) -> str | None:
    """The requested room name (None: pick one); ValueError with the reason if it is invalid."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object, e.g. {\"room\": \"my-room\"}")
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


def create_app(settings: WebSettings) -> web.Application:
    check_settings(settings)
    browser_url = settings.web_livekit_url or settings.livekit_url
    js_path = client_js_path(settings)

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

    async def token(request: web.Request) -> web.Response:
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
        room = room or f"web-{secrets.token_hex(4)}"
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

    app = web.Application(client_max_size=MAX_BODY, middlewares=[headers])
    for path in PAGES:
        app.router.add_get(path, page)
    app.router.add_get("/livekit-client.umd.js", client_js)
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
