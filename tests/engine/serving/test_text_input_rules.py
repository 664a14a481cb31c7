"""Input never reaches the model unchecked, and a worker never dies of a request (issue 43,
item 1). Real sockets on 127.0.0.1, a worker process, the tiny checkpoint whose utterances end
by EOS.

Text is checked once, in the server process (`protocol.check_text`): a lone surrogate (JSON's
"\\ud83d") or a noncharacter is a 400 naming the field on POST and an `error` event on the
socket; the worker's tokenizer never sees it (before: a streamed piece with one made the worker
exit and ended every stream batched on it, and POST answered 503). A request that fails inside
the worker anyway fails alone: its neighbour's audio is the audio it gives alone. Order is shown
by messages and engine state, never by time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import unicodedata

import aiohttp
import httpx
import pytest

from qwen3_tts_engine.dispatch.handler import HandlerError
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import (
    FRAME_SAMPLES,
    HEADER_CAPPED,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    Limits,
    parse_speech_request,
)
from qwen3_tts_engine.sentences import split_input
from tests.support.speech_socket import client_session, engine_server, until_done

pytestmark = pytest.mark.slow
API_KEY = "text-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
HANG_GUARD = 120
LIMIT = 12_000  # max_input_chars: the 10,000-character word reaches the model
SHORT = 2  # max_new_tokens of the fuzzed requests: a chunk of audio each


@pytest.fixture(scope="module")
async def server(tiny_checkpoint):
    checkpoint = str(tiny_checkpoint("custom_voice", eos="text"))
    async with engine_server(
        checkpoint, 4, api_key=API_KEY, limits=Limits(max_input_chars=LIMIT)
    ) as srv:
        yield srv


@pytest.fixture
async def session(server):
    async with client_session(server) as s:
        yield s


@pytest.fixture
async def client(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=AUTH,
                                 timeout=HANG_GUARD) as c:  # fmt: skip
        yield c


async def _post(client, body: dict, **kw):
    """POST the body as JSON with \\u escapes (what JSON clients send for any character)."""
    return await client.post("/v1/audio/speech", content=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"}, **kw)  # fmt: skip


def _connect(session):
    return session.ws_connect(SPEECH_STREAM_PATH, headers=AUTH, protocols=(SPEECH_STREAM_SUBPROTOCOL,),
                              timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD))  # fmt: skip


async def _session(session, *messages) -> tuple[list, int | None]:
    """Send the messages (the server may close before the last: an earlier one was refused),
    then every message up to the utterance's response.done (the socket stays open: close code
    None) or the error event and the server's close (its close code)."""
    async with _connect(session) as ws:
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionError):
            for m in messages:
                await ws.send_str(json.dumps(m))
        out = await until_done(ws)
        return out, ws.close_code if ws.closed else None


def _worker(server) -> tuple[int, int]:
    handler = server.engine.active
    assert handler.state == "ready" and handler.pid is not None
    return handler.pid, handler.restarts


async def _served(client) -> None:
    """The next request is served: audio, a 200."""
    r = await _post(client, {**START, "type": None, "input": "Still here.", "max_new_tokens": SHORT,
                             "response_format": "pcm"})  # fmt: skip
    assert r.status_code == 200 and len(r.content) == SHORT * FRAME_SAMPLES * 2, r.text


# -- the rule: 400 naming the field, on both paths ----------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("input", "Hi \ud83d"), ("input", "\udc00 low half first"), ("input", "Hi \ud83d\ud83d there"),
    ("input", "a noncharacter \ufdd0"), ("input", "plane one's last \U0001ffff"),
    ("instructions", "Speak \udfff warmly."), ("instructions", "Calm \ufffe voice."),
])  # fmt: skip
async def test_text_that_is_not_unicode_scalar_values_is_a_400_on_post(
    server, client, field, value
):
    """POST with a lone surrogate or a noncharacter in a text field: a 400 naming the field, the
    worker untouched (before: a 503 from the tokenizer's TypeError)."""
    worker = _worker(server)
    r = await _post(client, {"input": "Fine text.", **START, "type": None, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert f"U+{ord(next(c for c in value if ord(c) >= 0xD800)):04X}" in error["message"]
    assert _worker(server) == worker
    await _served(client)


@pytest.mark.parametrize(("where", "messages", "param"), [
    ("appended while speaking", [START, {"type": "input_text.append", "text": "Hello there, how are you "},
                                 {"type": "input_text.append", "text": "Hi \ud83d"}], "text"),
    ("the first piece", [START, {"type": "input_text.append", "text": "Hi \ud83d"}], "text"),
    ("a piece with a noncharacter", [START, {"type": "input_text.append", "text": "ok "},
                                     {"type": "input_text.append", "text": "\U0010fffe"}], "text"),
    ("in session.start's input", [{**START, "input": "Hi \ud83d"}], "input"),
    ("in session.start's instructions", [{**START, "instructions": "\udead"}], "instructions"),
])  # fmt: skip
async def test_text_that_is_not_unicode_scalar_values_is_an_error_event_on_the_socket(
        server, session, client, where, messages, param):  # fmt: skip
    """The socket: the same 400 as an `error` event naming the field, then the close code of a
    client error (1008); the worker keeps its pid and serves the next request (before: a piece
    with a lone surrogate made the worker exit, code 1)."""
    worker = _worker(server)
    events, code = await _session(session, *messages)
    errors = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    assert len(errors) == 1 and events[-1] is errors[0], events
    assert errors[0]["status"] == 400 and errors[0]["error"]["param"] == param, errors[0]
    assert code == 1008
    assert _worker(server) == worker
    await _served(client)


# -- random Unicode: a 4xx or audio, never a 5xx, never a new worker ----------------------------

CONTROLS = "".join(map(chr, [*range(0x00, 0x20), *range(0x7F, 0xA0)]))
FRAGMENTS = {
    "words": ["Hello there", "how are you", "fine, thanks.", "Numbers 1, 2 and 3!", "OK?"],
    "combining": [
        "e\u0301te\u0301",
        "a" + "\u0300\u0301\u0302\u0303\u0308" * 6,
        "\u0301\u0302start",
        "n\u0303o",
        "\u1100\u1161\u11a8",
    ],  # conjoining jamo: NFC composes them
    "rtl": ["שלום עולם", "مرحبا بالعالم", "\u202eevil\u202c", "\u200fRLM\u200e", "كَتَبَ"],
    "emoji": [
        "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
        "\U0001f3f3\ufe0f\u200d\U0001f308",
        "\U0001f44d\U0001f3fd",
        "\U0001f1fa\U0001f1f3",
        "\U0001f9d1\U0001f3ff\u200d\U0001f680",
    ],
    "cjk": ["你好，世界。", "こんにちは", "안녕하세요 여러분", "テスト"],
    "controls": [CONTROLS, "\x00", "\t\n\r", "\x85", "\x7f\x9f"],
    "format": ["\u200b", "\ufeff", "\u2060", "\u00ad", "\ue000", "\U0010fffd", "\u0378"],
    "surrogate": None,  # a random one of U+D800-DFFF
    "noncharacter": ["\ufdd0", "\ufdef", "\ufffe", "\uffff", "\U0001fffe", "\U0010ffff"],
}
WORD = "".join(random.Random(10_000).choices("abcdefghijklmnopqrstuvwxyz", k=10_000))


def _fragment(rng: random.Random, kind: str) -> str:
    if kind == "surrogate":
        return chr(rng.randrange(0xD800, 0xE000))
    return rng.choice(FRAGMENTS[kind])


def _fuzz_inputs(n: int, seed: int = 43) -> list[str]:
    """`n` texts: each kind of fragment alone first (and every control character, the 10,000
    character word), then random mixes of 1 to 5 fragments, mostly speakable."""
    rng = random.Random(seed)
    texts = [CONTROLS, f"Say {CONTROLS} this.", WORD, f"{WORD[:9_000]} and more"]
    texts += [_fragment(rng, kind) for kind in FRAGMENTS]
    kinds = [*FRAGMENTS, "words", "words", "words"]
    while len(texts) < n:
        texts.append(" ".join(_fragment(rng, rng.choice(kinds)) for _ in range(rng.randint(1, 5))))
    return texts


def _refused(text: str) -> bool:
    """What the rule refuses: a lone surrogate or a noncharacter."""
    return any(0xD800 <= ord(c) <= 0xDFFF or 0xFDD0 <= ord(c) <= 0xFDEF or ord(c) & 0xFFFE == 0xFFFE
               for c in text)  # fmt: skip


def _speakable(text: str) -> bool:
    return any(unicodedata.category(c)[0] not in "CZ" for c in text)


def _cut(rng: random.Random, text: str) -> list[str]:
    """The text in 1 to 4 pieces, cut anywhere (inside words, between a base and its marks)."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 3))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def _fuzz_post(client, text: str) -> None:
    # the prompt layout (this model's default) prefills the whole text: ~25 s for the 10,000
    # character word on 2 cores; dual-track tokenizes it all the same and prefills one token
    layout = {"text_mode": "dual"} if len(text) > 1000 else {}
    r = await _post(client, {**START, "type": None, "input": text, "max_new_tokens": SHORT,
                             "response_format": "pcm", **layout})  # fmt: skip
    assert r.status_code < 500, (ascii(text[:80]), r.status_code, r.text)
    if _refused(text) or not _speakable(text):
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", (
            ascii(text[:80]),
            r.text,
        )
    else:
        assert r.status_code == 200, (ascii(text[:80]), r.text)
        assert len(r.content) > 0 and len(r.content) % (FRAME_SAMPLES * 2) == 0
        # audio accepted: capped as asked (SHORT frames per piece the server speaks: the whole
        # text in dual-track, its sentences in the prompt layout), and said so when it was
        pieces = 1 if layout else len(split_input(text))
        frames = len(r.content) // (FRAME_SAMPLES * 2)
        assert frames <= SHORT * pieces, (ascii(text[:80]), frames, pieces)
        if r.headers.get(HEADER_CAPPED) == "true":
            assert frames >= SHORT, (ascii(text[:80]), frames)  # a piece ran to the cap


async def _fuzz_socket(session, rng: random.Random, text: str) -> None:
    # the stream starts at its 64th committed token or the text's end (most of these texts are
    # refused or spoken after their last piece arrived), SHORT frames at most
    start = {**START, "max_new_tokens": SHORT, "text_start_tokens": 64}
    messages = [start, *({"type": "input_text.append", "text": p} for p in _cut(rng, text)),
                {"type": "input_text.end"}]  # fmt: skip
    events, code = await _session(session, *messages)
    last = events[-1] if events else None
    assert isinstance(last, dict), (ascii(text[:80]), events)
    if last["type"] == "error":
        assert 400 <= last["status"] < 500 and code == 1008, (ascii(text[:80]), last)
        assert _refused(text) or not _speakable(text), (ascii(text[:80]), last)
        assert last["error"]["param"] in ("text", "input"), last
    else:
        assert last["type"] == "response.done" and code is None, (ascii(text[:80]), last)
        audio = b"".join(e for e in events if isinstance(e, bytes))
        assert len(audio) == last["samples"] * 2 > 0
        assert last["frames"] <= SHORT, (ascii(text[:80]), last)  # capped as asked
        if last["capped"]:  # said capped: it did run to its cap
            assert last["frames"] == SHORT, (ascii(text[:80]), last)
        # refused text can only be answered with audio by a stream that made its frames and
        # ended before the server read the refused piece (an error event follows the done)
        assert not _refused(text) or last["frames"] == SHORT, (ascii(text[:80]), last)


async def test_random_unicode_gets_a_4xx_or_audio_and_never_a_new_worker(server, session, client):
    """Seeded random Unicode (lone surrogates, combining marks, right-to-left text and marks,
    emoji ZWJ sequences, CJK, every C0 and C1 control character, format characters,
    noncharacters, a 10,000-character word) at POST and, cut into random pieces, at the socket,
    four requests at a time (batched in the worker): each answer is a 4xx or audio (no more
    frames than its cap), never a 5xx, and the worker keeps its pid throughout. 26 texts, each
    at both doors: 52 requests."""
    worker = _worker(server)
    texts = _fuzz_inputs(26)
    assert (
        sum(map(_refused, texts)) >= 4
        and sum(not _refused(t) and _speakable(t) for t in texts) >= 10
    )
    rng = random.Random(7)
    jobs = [j for t in texts for j in (_fuzz_post(client, t), _fuzz_socket(session, rng, t))]
    assert len(texts) == 26 and len(jobs) == 52
    for i in range(0, len(jobs), 4):
        await asyncio.gather(*jobs[i : i + 4])
        assert _worker(server) == worker
    await _served(client)


# -- a request that fails inside the worker fails alone -----------------------------------------

NEIGHBOUR = {**START, "type": None, "input": "A neighbour speaks its whole sentence meanwhile.",
             "response_format": "pcm", "stream": True, "seed": 11}  # fmt: skip


async def test_a_request_failing_in_the_worker_leaves_its_batched_neighbour_unchanged(
    server, client
):
    """A streamed-text request whose next piece the worker's tokenizer cannot take (a lone
    surrogate sent to the handler directly, past the server's check, as text from any path
    that skipped it would come), while a seeded neighbour is batched with it: that request
    fails with the engine's error, the neighbour's PCM is byte for byte what it gives alone,
    and the worker keeps its pid (before: the worker exited and took the neighbour with it)."""
    handler = server.engine.active
    worker = _worker(server)
    req = parse_speech_request({"voice": "ryan", "language": "en", "seed": 5}, text_stream=True)
    # text for many frames: it speaks (in the batch) until its failure
    text = TextInput("Hello there, how are you today? I am fine, thank you. " * 4)
    first_chunk = asyncio.Event()

    async def failing() -> BaseException | None:
        try:
            async for _ in handler.synthesize(req, text=text):
                first_chunk.set()
        except HandlerError as e:
            return e
        return None

    task = asyncio.ensure_future(failing())
    await asyncio.wait_for(first_chunk.wait(), HANG_GUARD)
    pcm = b""
    async with client.stream("POST", "/v1/audio/speech", content=json.dumps(NEIGHBOUR).encode(),
                             headers={"Content-Type": "application/json"}) as r:  # fmt: skip
        assert r.status_code == 200
        async for data in r.aiter_raw():
            if not pcm:  # the neighbour speaks: the other request's next piece breaks it
                text.append("and then \ud83d")
            pcm += data
    error = await asyncio.wait_for(task, HANG_GUARD)
    assert isinstance(error, HandlerError) and "died" not in str(error), error
    assert handler.last_stats["peak_batch"] >= 2  # the neighbour was batched with it
    assert _worker(server) == worker
    r = await _post(client, {**NEIGHBOUR, "stream": False})
    assert r.status_code == 200 and handler.last_stats["peak_batch"] == 1
    assert len(pcm) > 0 and pcm == r.content
