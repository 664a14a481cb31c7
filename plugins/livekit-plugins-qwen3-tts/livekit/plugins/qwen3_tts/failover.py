"""The one failover loop of the plugin: an utterance goes from engine to engine until one speaks
it, whichever transport carries it (an HTTP sentence: `http_sentence.py`; a socket: `text_socket.py`).

Each transport is an `Attempt`: one try on one endpoint, raising what went wrong there. The loop
decides what that means for the endpoint and for the utterance, the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from livekit.agents import APIStatusError

from .endpoints import Endpoint, EndpointPool
from .failures import ENDPOINT_FAILURES, final_error
from .log import logger


class EngineFull(Exception):
    """A 429 (on HTTP, or a socket's upgrade or `engine_full` error event): the engine's batch and
    queue are full; it is not broken, and another engine may have room."""

    def __init__(self, retry_after: float, body: str) -> None:
        super().__init__(f"HTTP 429 (retry after {retry_after:g} s): {body[:200]}")
        self.retry_after, self.body = retry_after, body


class AttemptReport(Protocol):
    endpoints: list[str]  # every endpoint tried, in order
    full: list[str]  # those that answered 429
    delivered_bytes: int


class Attempt(Protocol):
    """One utterance on one transport. `run(ep)` tries it once on `ep`: it returns once the
    utterance is spoken whole, or raises `EngineFull`, one of `ENDPOINT_FAILURES` (the endpoint
    failed), or LiveKit's error for the utterance itself (a 4xx: no other engine would do better).
    Audio is delivered through `replay.play_unheard`, so a later try skips what was heard."""

    report: AttemptReport
    what: str  # the utterance, for the log

    async def run(self, ep: Endpoint) -> None: ...


async def speak(pool: EndpointPool, attempt: Attempt, *,
                may_fail_over: Callable[[], bool] = lambda: True) -> None:  # fmt: skip
    """Try `attempt` on the pool's endpoints, each at most once, until one speaks it whole.

    A 429 marks the engine full for its Retry-After (not down) and passes the utterance to the
    next engine at once; a failed endpoint is marked down, and the utterance goes on elsewhere
    while `may_fail_over()` allows (a LiveKit retry makes one try until audio has played: see
    the streams' `_run`). When no endpoint is left, the last one's error is raised as LiveKit's
    (`APIStatusError` 429 when it was full, `final_error` when it failed).
    """
    report = attempt.report
    tried: set[str] = set()
    while True:
        ep = await pool.acquire(exclude=tried)  # counted outstanding until released
        tried.add(ep.url)
        report.endpoints.append(ep.url)
        try:
            await attempt.run(ep)
            return
        except EngineFull as e:  # full, not broken: another engine takes it at once
            pool.mark_full(ep, e.retry_after)
            report.full.append(ep.url)
            if not pool.untried(tried):
                raise APIStatusError(f"Qwen3-TTS engines are full ({len(tried)} tried; the last, "
                                     f"{ep.url}, asks to retry after {e.retry_after:g} s)",
                                     status_code=429, body=e.body, retryable=True) from e  # fmt: skip
            logger.info(
                "TTS endpoint %s is full (429): trying another for %s", ep.url, attempt.what
            )
        except ENDPOINT_FAILURES as e:
            pool.mark_down(ep, f"{type(e).__name__}: {e}")
            if not pool.untried(tried) or not may_fail_over():
                raise final_error(e, ep.url, len(tried), len(pool)) from e
            logger.warning("TTS failover from %s after %d samples of %s: %s", ep.url,
                           report.delivered_bytes // 2, attempt.what, e)  # fmt: skip
        finally:
            pool.release(ep)
