"""The one map from the engine's exceptions to HTTP answers (OpenAI-style JSON error bodies)."""

from __future__ import annotations

from aiohttp import web

from qwen3_tts_engine.dispatch.handler import HandlerError, QueueFull
from qwen3_tts_engine.governor.governor import SwapInProgress
from qwen3_tts_engine.protocol import ENGINE_FULL, RequestError

# First match wins: keep subclasses above their bases. A RequestError carries its own status.
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (QueueFull, 429),
    (SwapInProgress, 409),
    (HandlerError, 503),
)
_CODES = {QueueFull: ENGINE_FULL}  # the error body's "code" where it is a name
RETRY_STATUSES = (429, 503)  # answers that carry Retry-After


def as_request_error(err: Exception) -> RequestError:
    """`err` as the RequestError (and so the status) a client sees."""
    if isinstance(err, RequestError):
        return err
    for kind, status in _STATUS:
        if isinstance(err, kind):
            return RequestError(str(err), status=status, code=_CODES.get(kind))
    raise TypeError(f"no HTTP status for {type(err).__name__}") from err


# The exceptions `as_request_error` maps (for `except` clauses).
MAPPED: tuple[type[Exception], ...] = (RequestError, *(kind for kind, _ in _STATUS))


def error_response(err: Exception, *, retry_after_s: int | None = None) -> web.Response:
    e = as_request_error(err)
    headers = (
        {"Retry-After": str(retry_after_s)}
        if retry_after_s and e.status in RETRY_STATUSES
        else None
    )
    return web.json_response(e.to_json(), status=e.status, headers=headers)
