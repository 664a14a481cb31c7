"""How a try on one endpoint fails, and the LiveKit error raised when no endpoint is left: shared
by the HTTP requests (`tts.py`) and the streaming-text sockets (`text_socket.py`)."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
from livekit.agents import APIConnectionError, APIError, APIStatusError, APITimeoutError


class EndpointUnavailable(Exception):
    """A 5xx answer: this engine is broken or busy; another may not be."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status, self.body = status, body


class Stalled(Exception):
    """The endpoint accepted the request but sent nothing for `conn_options.timeout`."""


class SocketLost(Exception):
    """The streaming-text socket closed or broke before the engine said the utterance was done."""


# What fails one endpoint (and moves on to the next) rather than the request itself.
ENDPOINT_FAILURES = (httpx.TransportError, aiohttp.ClientError, EndpointUnavailable, Stalled,
                     SocketLost, asyncio.TimeoutError)  # fmt: skip


def final_error(e: Exception, url: str, tried: int, total: int) -> APIError:
    """LiveKit's error for the last endpoint failure of a request: all of them are retryable."""
    if isinstance(e, (httpx.TimeoutException, Stalled, asyncio.TimeoutError)):
        return APITimeoutError(f"Qwen3-TTS timed out at {url}: {e}")
    msg = f"Qwen3-TTS failed at {url} ({tried} of {total} endpoints tried): {e}"
    if isinstance(e, EndpointUnavailable):
        return APIStatusError(msg, status_code=e.status, body=e.body)
    return APIConnectionError(msg)
