"""One caller's socket costs nobody else anything (issue 50's acceptance, on a real socket):

- eight clients that vanish without closing (they never read, never answer a ping, never send
  again) while their text is open hold no real-time slot: once each stream is held (its text
  used up, its audio unread), another caller's POST is served whole while all eight are still
  connected with their text open: nobody had to cut them first (the heartbeat is off here, so
  only the slot lending can let the other caller in);
- 10,000 one-character appends of Chinese with no punctuation on a socket, paced by the
  engine's `input_text.ack` (a forced commit point acknowledges at least every 64 characters):
  another caller's first audio arrives while they are still going.

Order by events (an ack, a state, a byte), never by time. The other caller's first audio is
printed for the record (docs/benchmarks.md has the measured numbers), never asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from tests.engine.serving.test_socket_flow import _frame, _slow_reader
from tests.support.speech_socket import (
    HANG_GUARD,
    PATIENT_SOCKETS,
    client_session,
    connect,
    engine_server,
    receive,
)

pytestmark = pytest.mark.slow
API_KEY = "flow-key"  # _slow_reader's
HALF_OPEN = 8
PIECES = 10_000
BURST = 100  # > the 64 held characters: each burst forces a commit, so its ack comes
TEXT = "Hello there, how are you today? I hope the weather is fine where you are"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    # 4 rows: up to 8 held streams lend their slots (capacity.PARKED_PER_ROW)
    async with engine_server(checkpoint, 4, api_key=API_KEY, ws_ahead_s=0.5,
                             **PATIENT_SOCKETS) as srv:  # fmt: skip
        yield srv


async def _load(http) -> dict:
    async with http.get("/load") as r:
        return await r.json()


async def _first_audio_of_a_post(http, heard: asyncio.Event | None = None) -> tuple[float, int]:
    """(seconds to the first audio byte, bytes in all) of a streamed POST; `heard` is set at its
    first audio."""
    t0 = time.perf_counter()
    first, size = None, 0
    async with http.post("/v1/audio/speech", headers=AUTH,
                         json={"input": "Hello.", "voice": "ryan", "response_format": "pcm",
                               "stream": True, "seed": 1}) as r:  # fmt: skip
        assert r.status == 200, await r.text()
        async for data in r.content.iter_any():
            if first is None and data:
                first = time.perf_counter() - t0
                if heard is not None:
                    heard.set()
            size += len(data)
    assert first is not None and size > 0
    return first, size


async def test_half_open_clients_with_open_text_hold_no_slot(server):
    clients = []
    for i in range(HALF_OPEN):
        reader, writer, _ = await _slow_reader(server)
        start = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 10 + i}
        for message in (start, {"type": "input_text.append", "text": TEXT}):  # no end: text open
            writer.write(_frame(json.dumps(message).encode()))
        await writer.drain()
        clients.append((reader, writer))  # from here on: never read, never written
    try:
        async with client_session(server) as http:
            async with asyncio.timeout(HANG_GUARD * 5):  # each stream ran and is held now
                while (load := await _load(http))["held"] < HALF_OPEN or load["waiting"]:
                    await asyncio.sleep(0.05)
            assert load["running"] == 0 and load["sessions"] >= HALF_OPEN, load
            first, size = await _first_audio_of_a_post(http)
            # all eight still there, their text open, their streams unfinished
            open_ = [s for s in server.sockets.sessions
                     if s.utterance is not None and not s.utterance.settled
                     and not s.utterance.text.ended]  # fmt: skip
            assert len(open_) == HALF_OPEN
            print(f"other caller beside {HALF_OPEN} half-open clients: first audio {first:.3f} s")
    finally:
        for _, writer in clients:
            writer.transport.abort()


async def test_ten_thousand_cjk_appends_on_a_socket_do_not_stall_another_caller(server):
    rng = random.Random(3)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(PIECES))
    appended, heard_at = 0, None
    async with client_session(server) as http:
        async with connect(http, API_KEY) as ws:
            await ws.send_json({"type": "session.start", "voice": "ryan", "language": "chinese",
                                "seed": 5})  # fmt: skip
            assert (await receive(ws))["type"] == "session.created"

            [utt] = [s.utterance for s in server.sockets.sessions if s.utterance is not None
                     and s.utterance.text.chars == 0 and not s.utterance.settled]  # fmt: skip
            heard = asyncio.Event()
            other = asyncio.ensure_future(_first_audio_of_a_post(http, heard))
            try:
                while appended < PIECES:
                    burst, tokens = cjk[appended : appended + BURST], utt.text.tokens
                    for ch in burst:
                        await ws.send_json({"type": "input_text.append", "text": ch})
                    appended += len(burst)
                    if heard_at is None and heard.is_set():
                        heard_at = appended
                    if heard_at is None:
                        # paced by the engine until the other caller is heard: the worker
                        # committed some of this burst (a forced commit comes every 64 held
                        # characters: the utterance's committed token count grows)
                        async with asyncio.timeout(HANG_GUARD):
                            while utt.text.tokens == tokens and not utt.settled:
                                await asyncio.sleep(0.005)
                        assert not utt.settled, "the abuser's utterance ended (an error?)"
                first, _ = await other
            finally:
                other.cancel()
            await ws.send_json({"type": "response.cancel"})
    assert heard_at is not None and heard_at < PIECES, "the other caller waited for all appends"
    print(f"other caller beside {PIECES} one-character appends: first audio {first:.3f} s, "
          f"after {heard_at} appends")  # fmt: skip
