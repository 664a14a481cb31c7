"""Bearer-token auth for `/v1/*`: the server's check and the header a client sends."""

from __future__ import annotations

import hmac


def bearer_header(api_key: str | None) -> dict[str, str]:
    """The request header for `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def authorized(header: str | None, api_key: str | None) -> bool:
    """True when no key is configured, or `header` carries it (constant-time compare)."""
    if not api_key:
        return True
    got = header or ""
    return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())
