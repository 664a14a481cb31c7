"""No task of the plugin's endpoint pool outlives the work that needs it (issue 35).

LiveKit's `tts.StreamAdapter` never closes the TTS it wraps, so whatever the pool leaves running
after a stream ends is still pending when LiveKit's leaked-task check runs. Loopback speech servers
(`FaultEngine`, test_failover.py) stand in for engines that stall.
"""

from __future__ import annotations

import asyncio

import pytest
from livekit.agents import APIConnectOptions, tokenize
from livekit.agents.tts import StreamAdapter
from livekit.plugins import qwen3_tts

from tests.plugins.qwen3_tts.test_failover import (
    PATIENT_CLIENT,
    STALL_TIMEOUT,
    WAIT,
    FaultEngine,
    fake_pcm,
)
from tests.support.tts_audio import stream_text

pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")


def _pool_tasks() -> list[asyncio.Task]:
    return [
        t for t in asyncio.all_tasks() if t.get_name().startswith("qwen3-tts-") and not t.done()
    ]


async def test_a_stream_adapter_stream_leaves_no_pool_task_after_a_stall():
    """x stalls (speech and /ready alike), the sentence fails over to y; once the adapter's stream
    has ended, no probe of x (nor any other pool task) is left, with the TTS still open."""
    x, y = await FaultEngine().start(), await FaultEngine().start()
    x.fault, x.stall_ready = "stall_head", True
    y.running = 1  # x is the less loaded: tried first
    inner = qwen3_tts.TTS(base_url=[x.url, y.url], voice="ryan", language="en", probe_interval=0.05,
                          timeout=PATIENT_CLIENT)  # fmt: skip
    adapter = StreamAdapter(tts=inner, sentence_tokenizer=tokenize.basic.SentenceTokenizer())
    try:
        # x never answers: the timeout fails it over to y at any speed
        conn = APIConnectOptions(max_retry=0, timeout=STALL_TIMEOUT)
        _, audio = await asyncio.wait_for(
            stream_text(adapter, ["Said by y."], conn_options=conn), WAIT
        )
        assert len(audio) == len(fake_pcm("Said by y.", y.seen[0]["seed"])) // 2
        assert not inner.endpoints.endpoints[0].healthy  # x was marked down: it would be probed
        assert _pool_tasks() == []
    finally:
        await adapter.aclose()
        await inner.aclose()
        await x.stop()
        await y.stop()
