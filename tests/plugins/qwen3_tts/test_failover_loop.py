"""The plugin's one failover loop (`failover.speak`), which both transports use, on scripted
attempts: what each outcome on an endpoint does to the endpoint and to the utterance. The
transports against real sockets and servers: test_failover.py (HTTP sentences),
test_text_socket_failover.py and test_text_stream.py (the streaming-text socket)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest
from livekit.agents import APIConnectionError, APIStatusError

from livekit.plugins.qwen3_tts import failover
from livekit.plugins.qwen3_tts.endpoints import Endpoint, EndpointPool
from livekit.plugins.qwen3_tts.failures import EndpointUnavailable, SocketLost

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


@dataclass
class Report:
    endpoints: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    delivered_bytes: int = 0


class Scripted:
    """An attempt whose try on each endpoint does what `outcomes` says (None: speaks it whole)."""

    def __init__(self, outcomes: dict[str, Exception | None]) -> None:
        self.outcomes = outcomes
        self.report = Report()
        self.what = "a scripted utterance"

    async def run(self, ep: Endpoint) -> None:
        if (outcome := self.outcomes[ep.url]) is not None:
            raise outcome


@pytest.fixture
async def pool():
    client = httpx.AsyncClient()
    pool = EndpointPool(URLS, client, strategy="priority")  # tried in order: the script's order
    yield pool
    await pool.aclose()
    await client.aclose()


async def test_full_moves_on_without_marking_down_and_a_failure_marks_down(pool):
    a, b, c = URLS
    attempt = Scripted({a: failover.EngineFull(4.0, "full"), b: EndpointUnavailable(503, "busy"),
                        c: None})  # fmt: skip
    await failover.speak(pool, attempt)
    assert attempt.report.endpoints == [a, b, c] and attempt.report.full == [a]
    ep_a, ep_b, ep_c = pool.endpoints
    assert ep_a.healthy and ep_a.rejections == 1 and ep_a.busy_until > time.monotonic() + 3
    assert not ep_b.healthy and ep_b.failures == 1 and "503" in ep_b.last_error
    assert ep_c.healthy and all(ep.outstanding == 0 for ep in pool.endpoints)


async def test_all_full_raises_429_after_each_engine_was_tried(pool):
    attempt = Scripted({url: failover.EngineFull(2.0, "full") for url in URLS})
    with pytest.raises(APIStatusError) as e:
        await failover.speak(pool, attempt)
    assert e.value.status_code == 429 and e.value.retryable
    assert attempt.report.endpoints == URLS == attempt.report.full
    assert all(ep.healthy for ep in pool.endpoints)


async def test_a_failure_raises_livekits_error_when_no_failover_is_allowed(pool):
    a, b, c = URLS
    attempt = Scripted({a: SocketLost("closed"), b: None, c: None})
    with pytest.raises(APIConnectionError):
        await failover.speak(pool, attempt, may_fail_over=lambda: False)
    assert attempt.report.endpoints == [a]  # a LiveKit retry makes one try until audio played


async def test_a_full_engine_is_passed_over_even_where_no_failover_is_allowed(pool):
    """A 429 means nothing was made there: the next engine takes it in any round."""
    a, b, c = URLS
    attempt = Scripted({a: failover.EngineFull(1.0, "full"), b: None, c: None})
    await failover.speak(pool, attempt, may_fail_over=lambda: False)
    assert attempt.report.endpoints == [a, b]


async def test_the_callers_own_error_is_raised_at_once(pool):
    a, b, c = URLS
    attempt = Scripted({a: APIStatusError("bad voice", status_code=400, retryable=False), b: None,
                        c: None})  # fmt: skip
    with pytest.raises(APIStatusError, match="bad voice"):
        await failover.speak(pool, attempt)
    assert attempt.report.endpoints == [a] and pool.endpoints[0].healthy
