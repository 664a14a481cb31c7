"""Bearer-token auth for `/v1/*`: the server's checks and the header a client sends
(`Authorization: Bearer <key>`, or `Api-Key <key>` as Baseten's clients send it).

Two keys: the API key (synthesis, models, status) and an optional operator key, which alone may
change the engine (its served variant, fault injection) when it is set (and is accepted
wherever the API key is).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from aiohttp import web

from qwen3_tts_engine.protocol import RequestError

API_KEY_ENV = "QWEN3_TTS_API_KEY"
OPERATOR_KEY_ENV = "QWEN3_TTS_OPERATOR_KEY"


def bearer_header(api_key: str | None) -> dict[str, str]:
    """The request header for `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


SCHEMES = ("Bearer ", "Api-Key ")  # LiveKit's baseten.TTS sends `Api-Key <key>`


def carries(header: str | None, key: str) -> bool:
    """`header` is "Bearer <key>" or "Api-Key <key>" (constant-time compare)."""
    got = header or ""
    scheme = next((s for s in SCHEMES if got.startswith(s)), None)
    return scheme is not None and hmac.compare_digest(got[len(scheme) :].encode(), key.encode())


def authorized(header: str | None, api_key: str | None, operator_key: str | None = None) -> bool:
    """True when no key is configured, or `header` carries the API key or the operator key."""
    if not api_key and not operator_key:
        return True
    return any(carries(header, k) for k in (api_key, operator_key) if k)


# Who may call a route: anyone (probes, load, metrics), the API key's holders (or the operator
# key's), or the operator key's alone when one is set (changing the variant).
PUBLIC, API, OPERATOR = "public", "api", "operator"


def refusal(
    header: str | None, need: str, api_key: str | None, operator_key: str | None
) -> RequestError | None:
    """Why a request with this Authorization `header` may not call a route that needs `need`
    (None: it may). The one place a 401 or 403 is decided."""
    if need == PUBLIC:
        return None
    if need == OPERATOR and operator_key:
        if carries(header, operator_key):
            return None
        if api_key and carries(header, api_key):
            return RequestError("changing the engine (its variant, a fault) needs the operator key "
                                f"({OPERATOR_KEY_ENV}), not the API key", status=403)  # fmt: skip
        return RequestError("missing or wrong bearer token (the operator key)", status=401)
    if authorized(header, api_key, operator_key if need == API else None):
        return None
    return RequestError("missing or wrong bearer token", status=401)


def auth_middleware(rules: dict[str, str], api_key: str | None, operator_key: str | None,
                    refused: Callable[[RequestError], web.StreamResponse]):  # fmt: skip
    """aiohttp middleware: each route's rule (`rules`: "METHOD path" -> PUBLIC, API or OPERATOR;
    a route not named needs the API key) is checked before its handler runs, a WebSocket's
    before its upgrade. `refused` answers (and counts) a refusal."""

    @web.middleware
    async def check(request: web.Request, handler):
        resource = request.match_info.route.resource
        if resource is None:  # no such route: aiohttp's 404/405
            return await handler(request)
        need = rules.get(f"{request.method} {resource.canonical}", API)
        if (
            why := refusal(request.headers.get("Authorization"), need, api_key, operator_key)
        ) is not None:
            return refused(why)
        return await handler(request)

    return check


def is_loopback(host: str) -> bool:
    """`host` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a host name or "" (every interface): reachable from elsewhere
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return (mapped or ip).is_loopback


def exposure_problem(host: str, api_key: str | None, operator_key: str | None) -> str | None:
    """Why serving on `host` with these keys would be an open engine on a network, or None."""
    if is_loopback(host) or api_key:
        return None
    what = "an operator key only" if operator_key else "no API key"
    return (
        f"refusing to listen on {host} with {what}: anyone who can reach it could synthesize "
        f"and read the engine's status. Set {API_KEY_ENV} (clients send it as a bearer token), "
        "listen on 127.0.0.1, or pass --insecure-no-auth if an open engine is what you mean"
    )
