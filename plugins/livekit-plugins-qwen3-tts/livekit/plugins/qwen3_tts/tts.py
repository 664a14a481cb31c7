"""LiveKit TTS for Qwen3-TTS engines (ours on MLX, or vLLM-Omni on GPUs) over streaming HTTP,
or over our engine's streaming-text WebSocket (`text_input`; the socket: `text_socket.py`).

In sentence mode, text from the LLM is cut into sentences; each is synthesized as soon as it is complete, while the
previous one still plays, so the prefill of sentence N+1 hides behind the audio of sentence N.
A reply's first clause goes ahead on its own, with a small first chunk (`clauses.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp
import httpx
from livekit.agents import (
    APIConnectOptions,
    APIStatusError,
    tokenize,
    tts,
    utils,
)
from livekit.agents.telemetry import tracer
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from .clauses import FirstClauseTokenizer
from .discovery import Resolver
from .endpoints import Endpoint, EndpointPool, check_strategy
from .failures import ENDPOINT_FAILURES, EndpointUnavailable, Stalled, final_error
from .log import logger
from .models import (
    FirstChunkFrames,
    Protocol,
    Strategy,
    TaskTypes,
    TextInput,
    TTSLanguages,
    TTSModels,
    TTSVoices,
    Variants,
)
from .protocol import (
    HEADER_VARIANT,
    MSG_SESSION_START,
    SAMPLE_RATE,
    error_message,
    has_speakable_text,
    normalize_language,
    retry_after_s,
)
from .replay import play_unheard
from .segment_text import SegmentText
from .text_socket import NoTextStreaming, TextSocket, TextStreamReport

DEFAULT_URL = "http://127.0.0.1:8880"
# The owned HTTP client's default, which bounds the `/ready` probes: a healthy engine answers at
# once. Synthesis requests are bounded by `conn_options.timeout` alone.
DEFAULT_TIMEOUT = httpx.Timeout(2.0)
_TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


@dataclass
class _TTSOptions:
    model: str
    voice: str | None
    language: str
    instructions: str | None
    ref_audio: str | None
    ref_text: str | None
    task_type: str | None
    variant: str | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    seed: int | None
    max_new_tokens: int | None
    first_chunk_frames: int
    protocol: Protocol
    prefetch: int
    first_clause_min_words: int | None = 3
    # the first chunk of a segment's first request (None: first_chunk_frames); 2: bench first-chunk
    first_clause_chunk_frames: int | None = 2
    text_input: TextInput = "auto"

    def __post_init__(self) -> None:  # also checks what update_options() changes
        if self.first_chunk_frames not in (1, 2, 4):
            raise ValueError("first_chunk_frames must be 1, 2 or 4")
        if self.prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        if self.protocol not in ("qwen3-tts", "vllm-omni"):
            raise ValueError("protocol must be 'qwen3-tts' or 'vllm-omni'")
        if self.task_type is not None and self.task_type not in _TASK_TYPES:
            raise ValueError(f"task_type must be one of {', '.join(_TASK_TYPES)}")
        m = self.first_clause_min_words
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError("first_clause_min_words must be an integer >= 0, or None "
                             f"(0 or None: no first clause on its own), not {m!r}")  # fmt: skip
        if self.text_input not in ("auto", "stream", "sentences"):
            raise ValueError(
                f"text_input must be 'auto', 'stream' or 'sentences', not {self.text_input!r}"
            )
        if self.text_input == "stream" and self.protocol != "qwen3-tts":
            raise ValueError(
                "text_input='stream' needs protocol='qwen3-tts' (vLLM-Omni takes sentences)"
            )
        if self.first_clause_chunk_frames not in (None, 1, 2, 4):
            raise ValueError("first_clause_chunk_frames must be 1, 2, 4 or None (None: "
                             f"first_chunk_frames), not {self.first_clause_chunk_frames!r}")  # fmt: skip

    def for_request(self, index: int) -> _TTSOptions:
        """The options of a segment's `index`-th request: with the first-clause split on, the
        first asks for the small first chunk (never larger than `first_chunk_frames`)."""
        if index or not self.first_clause_min_words or not self.first_clause_chunk_frames:
            return self
        frames = min(self.first_clause_chunk_frames, self.first_chunk_frames)
        return replace(self, first_chunk_frames=frames)

    def streams_text(self) -> bool | None:
        """Whether a stream's segments go over the streaming-text socket: None: ask the engine."""
        if self.text_input == "sentences" or self.protocol != "qwen3-tts":
            return False
        return True if self.text_input == "stream" else None

    def stream_start(self, seed: int) -> dict:
        """The `session.start` message of a streamed segment: the fields of a request, with the
        small first chunk of a reply's first request when one is set (never larger than
        `first_chunk_frames`)."""
        frames = min(
            self.first_clause_chunk_frames or self.first_chunk_frames, self.first_chunk_frames
        )
        body = replace(self, first_chunk_frames=frames).request_body("", seed)
        del body["input"], body["stream"]
        return {"type": MSG_SESSION_START, **body}

    def request_body(self, text: str, seed: int | None) -> dict:
        """The JSON for one sentence. vLLM-Omni gets only the fields it defines."""
        body = {
            "model": self.model, "input": text, "voice": self.voice, "response_format": "pcm",
            "stream": True, "language": self.language.capitalize(),
            "task_type": _TASK_TYPES.get(self.task_type) if self.task_type else None,
            "instructions": self.instructions, "ref_audio": self.ref_audio,
            "ref_text": self.ref_text, "max_new_tokens": self.max_new_tokens,
        }  # fmt: skip
        if self.protocol == "qwen3-tts":
            body.update(
                variant=self.variant, temperature=self.temperature, top_k=self.top_k,
                top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=seed,
                first_chunk_frames=self.first_chunk_frames,
            )  # fmt: skip
        return {k: v for k, v in body.items() if v is not None}


@dataclass
class SentenceReport:
    """What happened to one sentence: for logs, metrics and tests."""

    text: str
    delivered_bytes: int = 0
    endpoints: list[str] = field(default_factory=list)
    variant: str | None = None
    first_audio_s: float | None = None
    skipped_bytes: int = 0  # audio re-synthesized after a failover but not played again
    full: list[str] = field(default_factory=list)  # endpoints that answered 429 (engine full)
    seed: int | None = None  # sent with every attempt, so that a failover repeats the same audio
    first_chunk_frames: int | None = None  # the first chunk asked of the engine

    @property
    def samples(self) -> int:
        return self.delivered_bytes // 2


class TTS(tts.TTS):
    def __init__(
        self,
        *,
        base_url: str | list[str] | None = None,
        api_key: str | None = None,
        model: TTSModels | str = "qwen3-tts",
        voice: TTSVoices | str | None = None,
        language: TTSLanguages | str = "auto",
        instructions: str | None = None,
        ref_audio: str | None = None,
        ref_text: str | None = None,
        task_type: TaskTypes | None = None,
        variant: Variants | str | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        first_chunk_frames: FirstChunkFrames = 4,
        first_clause_min_words: int | None = 3,
        first_clause_chunk_frames: int | None = 2,
        protocol: Protocol = "qwen3-tts",
        text_input: TextInput = "auto",
        prefetch: int = 1,
        strategy: Strategy = "balanced",
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        probe_interval: float = 2.0,
        load_interval: float = 0.5,
        resolve_interval: float = 10.0,
        resolver: Resolver | None = None,
        tokenizer: tokenize.SentenceTokenizer | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        """Qwen3-TTS over HTTP.

        `base_url` takes one or more engine URLs (default: `QWEN3_TTS_URL`, comma-separated, or
        http://127.0.0.1:8880). An http:// URL whose host name resolves to several addresses
        (a headless Service) is one engine per address, re-resolved every `resolve_interval` s
        (`resolver`: an `async (host, port) -> addresses` in place of the system's). Each request
        goes to one engine by `strategy`: "balanced" (least used by this client's requests in
        flight and the engine's free slots from `GET /load`, read every `load_interval` s while
        a stream is open; power of two choices) or "priority" (the first healthy URL in order).
        A request fails over to another engine when one dies; one that answers 429 (full) is
        passed over for its Retry-After without being marked down. Use
        `protocol="vllm-omni"` for a vLLM-Omni server (only its own fields are sent).
        `text_input` says how a stream's text reaches the engine: `"stream"` as the LLM writes it,
        over the engine's streaming-text WebSocket (one socket per reply segment); `"sentences"`
        as one HTTP request per sentence (below); `"auto"` streams where the engine's status says
        `streaming_text` (read once per endpoint) and sends sentences elsewhere (vLLM-Omni and
        older engines). `synthesize()` always makes one HTTP request.
        `prefetch` is how many sentences may be requested ahead of the one playing.
        The first request of each segment carries only its first clause, once that has
        `first_clause_min_words` words (0 or None: whole sentences only), and asks for a
        smaller first chunk: `first_clause_chunk_frames` frames (default 2; None:
        `first_chunk_frames`); a streamed segment's socket asks for the same first chunk.
        Each attempt on an endpoint gets `conn_options.timeout` (LiveKit's per-request option) to
        connect and between received bytes; a stalled endpoint is failed over and marked down.
        A request's first attempt fails over through the endpoints; each of LiveKit's retries
        (`conn_options.max_retry`) is one more try on one endpoint, so at most
        `len(base_url) + max_retry` tries are made before an error is raised.
        `timeout` is the default of the HTTP client made here, which bounds what `conn_options`
        does not: the `/ready` probes of endpoints (requests override it with `conn_options`).
        """
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True),
            sample_rate=SAMPLE_RATE,
            num_channels=1,
        )
        urls = base_url or os.environ.get("QWEN3_TTS_URL", DEFAULT_URL)
        urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls)
        self._opts = _TTSOptions(
            model=model, voice=voice, language=normalize_language(language),
            instructions=instructions, ref_audio=ref_audio, ref_text=ref_text,
            task_type=task_type, variant=variant, temperature=temperature, top_k=top_k,
            top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
            max_new_tokens=max_new_tokens, first_chunk_frames=first_chunk_frames,
            protocol=protocol, prefetch=prefetch, first_clause_min_words=first_clause_min_words,
            first_clause_chunk_frames=first_clause_chunk_frames, text_input=text_input,
        )  # fmt: skip
        api_key = api_key or os.environ.get("QWEN3_TTS_API_KEY")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self._owns_client = http_client is None
        self._client = http_client or httpx.AsyncClient(
            timeout=self._timeout, limits=httpx.Limits(max_connections=64)
        )
        self._pool = EndpointPool(urls, self._client, strategy=strategy, probe_interval=probe_interval,
                                  load_interval=load_interval, resolve_interval=resolve_interval,
                                  resolver=resolver, headers=self._headers)  # fmt: skip
        self._ws_session: aiohttp.ClientSession | None = None  # made when first needed
        self._tokenizer = tokenizer or tokenize.basic.SentenceTokenizer()
        self._streams: weakref.WeakSet[ChunkedStream | SynthesizeStream] = weakref.WeakSet()
        self._closed = False

    @property
    def model(self) -> str:
        return self._opts.model

    @property
    def provider(self) -> str:
        return "qwen3-tts"

    @property
    def endpoints(self) -> EndpointPool:
        return self._pool

    def update_options(
        self,
        *,
        model: NotGivenOr[TTSModels | str] = NOT_GIVEN,
        voice: NotGivenOr[TTSVoices | str | None] = NOT_GIVEN,
        language: NotGivenOr[TTSLanguages | str] = NOT_GIVEN,
        instructions: NotGivenOr[str | None] = NOT_GIVEN,
        ref_audio: NotGivenOr[str | None] = NOT_GIVEN,
        ref_text: NotGivenOr[str | None] = NOT_GIVEN,
        task_type: NotGivenOr[TaskTypes | None] = NOT_GIVEN,
        variant: NotGivenOr[Variants | str | None] = NOT_GIVEN,
        temperature: NotGivenOr[float | None] = NOT_GIVEN,
        top_k: NotGivenOr[int | None] = NOT_GIVEN,
        top_p: NotGivenOr[float | None] = NOT_GIVEN,
        repetition_penalty: NotGivenOr[float | None] = NOT_GIVEN,
        seed: NotGivenOr[int | None] = NOT_GIVEN,
        max_new_tokens: NotGivenOr[int | None] = NOT_GIVEN,
        first_chunk_frames: NotGivenOr[FirstChunkFrames] = NOT_GIVEN,
        first_clause_min_words: NotGivenOr[int | None] = NOT_GIVEN,
        first_clause_chunk_frames: NotGivenOr[FirstChunkFrames | None] = NOT_GIVEN,
        text_input: NotGivenOr[TextInput] = NOT_GIVEN,
        prefetch: NotGivenOr[int] = NOT_GIVEN,
        strategy: NotGivenOr[Strategy] = NOT_GIVEN,
    ) -> None:
        """Change options given here, checked as the constructor checks them (a bad value
        raises ValueError and changes nothing); streams already open keep the options they
        started with (`strategy` applies to the next request of any stream)."""
        changes = {k: v for k, v in locals().items() if k != "self" and is_given(v)}
        if "language" in changes:
            changes["language"] = normalize_language(changes["language"])
        new_strategy = changes.pop("strategy", None)
        if new_strategy is not None:
            check_strategy(new_strategy)
        self._opts = replace(self._opts, **changes)
        if new_strategy is not None:
            self._pool.strategy = new_strategy

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        self._check_open()
        stream = ChunkedStream(tts=self, input_text=text, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> SynthesizeStream:
        self._check_open()
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        self._pool.prewarm()

    async def aclose(self) -> None:
        """Close every stream still open (their requests and prefetches end), stop probing and
        close the owned HTTP client. Later `synthesize()`/`stream()` calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(s.aclose() for s in list(self._streams)), return_exceptions=True)
        await self._pool.aclose()
        if self._ws_session is not None:
            await self._ws_session.close()
        if self._owns_client:
            await self._client.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this qwen3_tts.TTS is closed (aclose() was called): make a new one")

    def _ws_http(self) -> aiohttp.ClientSession:
        """The aiohttp session of the text sockets: the job's (LiveKit closes it when the job
        ends), or outside a job one of our own, closed by `aclose()`."""
        if self._ws_session is not None:
            return self._ws_session
        try:
            return utils.http_context.http_session()
        except RuntimeError:  # no job context (scripts, tests, the demo)
            self._ws_session = aiohttp.ClientSession()
            return self._ws_session

    def _text_socket(self, opts: _TTSOptions, conn: APIConnectOptions, deliver, on_sent,
                     fail_over: Callable[[], bool]) -> TextSocket:  # fmt: skip
        """The socket side of one streamed segment, with a seed of its own (for failover)."""
        seed = opts.seed if opts.seed is not None else random.randrange(2**31)
        return TextSocket(pool=self._pool, session=self._ws_http(), headers=self._headers,
                          start=opts.stream_start(seed), conn=conn, deliver=deliver,
                          on_sent=on_sent, fail_over=fail_over,
                          ask_engine=opts.streams_text() is None)  # fmt: skip

    # -- one sentence, with failover ---------------------------------------------------------

    async def _speak(
        self, opts: _TTSOptions, report: SentenceReport, deliver, on_sent,
        conn: APIConnectOptions, ahead: asyncio.Future | None = None,
        fail_over: Callable[[], bool] = lambda: True,
    ) -> None:  # fmt: skip
        """Stream one sentence's PCM into `deliver`, failing over between endpoints.

        After a failover the sentence is requested again from the next endpoint, with the same
        seed, and the bytes already delivered are skipped: nothing is played twice, nothing lost.
        Each endpoint is tried at most once, and only while `fail_over()` allows another try
        (a retry of LiveKit's makes one try until audio has played: see the streams' `_run`).
        `conn.timeout` bounds each attempt's connect and every wait for bytes; for a sentence
        requested ahead, the wait for its first byte counts from when `ahead` (the sentence
        queued before it) is done, since an engine synthesizes its requests one after another.
        """
        seed = opts.seed if opts.seed is not None else random.randrange(2**31)
        report.seed = seed
        report.first_chunk_frames = opts.first_chunk_frames
        body = opts.request_body(report.text, seed)
        tried: set[str] = set()
        t0 = time.perf_counter()
        while True:
            ep = await self._pool.acquire(exclude=tried)
            tried.add(ep.url)
            report.endpoints.append(ep.url)
            try:
                await self._speak_once(ep, body, report, deliver, on_sent, t0, conn, ahead)
                return
            except _EngineFull as e:  # full, not broken: another engine takes it at once
                self._pool.mark_full(ep, e.retry_after)
                report.full.append(ep.url)
                if not self._pool.untried(tried):
                    raise APIStatusError(f"Qwen3-TTS engines are full ({len(tried)} tried; the last, "
                                         f"{ep.url}, asks to retry after {e.retry_after:g} s)",
                                         status_code=429, body=e.body, retryable=True) from e  # fmt: skip
                logger.info("TTS endpoint %s is full (429): trying another", ep.url)
            except ENDPOINT_FAILURES as e:
                self._pool.mark_down(ep, f"{type(e).__name__}: {e}")
                if not self._pool.untried(tried) or not fail_over():
                    raise final_error(e, ep.url, len(tried), len(self._pool)) from e
                logger.warning("TTS failover from %s after %d samples of %r: %s", ep.url,
                               report.samples, report.text[:40], e)  # fmt: skip
            finally:
                self._pool.release(ep)

    async def _speak_once(
        self, ep: Endpoint, body, report: SentenceReport, deliver, on_sent, t0,
        conn: APIConnectOptions, ahead: asyncio.Future | None,
    ) -> None:  # fmt: skip
        # A span in LiveKit's trace of the turn; the engine continues it (W3C traceparent).
        attrs = {"qwen3_tts.endpoint": ep.url, "qwen3_tts.text_chars": len(report.text)}
        with tracer.start_as_current_span("qwen3_tts.request", kind=SpanKind.CLIENT,
                                          attributes=attrs) as span:  # fmt: skip
            headers = dict(self._headers)
            propagate.inject(headers)
            try:
                await self._request(ep, body, report, deliver, on_sent, t0, conn, ahead, headers)
            finally:
                span.set_attributes({"qwen3_tts.variant": report.variant or "",
                                     "qwen3_tts.first_audio_s": report.first_audio_s or -1.0,
                                     "qwen3_tts.delivered_bytes": report.delivered_bytes})  # fmt: skip

    async def _request(
        self, ep: Endpoint, body, report: SentenceReport, deliver, on_sent, t0,
        conn: APIConnectOptions, ahead: asyncio.Future | None, headers: dict[str, str],
    ) -> None:  # fmt: skip
        on_sent()  # the text goes to the model now: LiveKit's TTFB starts here
        # Reads are timed here (not by httpx) so that a queued sentence's wait can be excused.
        timeout = httpx.Timeout(conn.timeout, read=None)
        request = self._client.build_request("POST", f"{ep.url}/v1/audio/speech", json=body,
                                             headers=headers, timeout=timeout)  # fmt: skip
        r = await self._open(request, conn.timeout, ahead)
        try:
            if r.status_code != 200:  # an error body is short; one that stalls is cut
                try:
                    async with asyncio.timeout(conn.timeout):
                        await r.aread()
                except TimeoutError:
                    raise Stalled(f"HTTP {r.status_code} with a body that stalled") from None
            if r.status_code == 429:  # full: its batch and queue; another engine may have room
                raise _EngineFull(retry_after_s(r.headers.get("Retry-After")), r.text)
            if r.status_code >= 500:  # this engine is broken or busy; another may not be
                raise EndpointUnavailable(r.status_code, r.text)
            if r.status_code != 200:
                raise APIStatusError(_error_message(r), status_code=r.status_code,
                                     request_id=r.headers.get("x-request-id"), body=r.text)  # fmt: skip
            self._pool.mark_up(ep)
            report.variant = r.headers.get(HEADER_VARIANT)
            received = 0
            async with contextlib.aclosing(r.aiter_raw()) as chunks:
                while True:
                    try:
                        async with asyncio.timeout(conn.timeout):
                            data = await anext(chunks, None)
                    except TimeoutError:
                        stall = f"no audio for {conn.timeout:g} s after {received} bytes"
                        raise Stalled(stall) from None
                    if data is None:
                        break
                    play_unheard(report, data, received, t0, deliver)
                    received += len(data)
        finally:
            await r.aclose()

    async def _open(
        self, request: httpx.Request, timeout: float, ahead: asyncio.Future | None
    ) -> httpx.Response:
        """Send `request`; wait for the response head `timeout` s, counted once `ahead` is done."""
        send = asyncio.ensure_future(self._client.send(request, stream=True))
        try:
            if ahead is not None:
                await asyncio.wait({send, ahead}, return_when=asyncio.FIRST_COMPLETED)
            return await asyncio.wait_for(send, timeout)
        except TimeoutError:
            raise Stalled(f"no response for {timeout:g} s") from None
        except BaseException:
            send.cancel()
            await asyncio.wait({send})
            if not send.cancelled() and send.exception() is None:
                await send.result().aclose()
            raise


class _EngineFull(Exception):
    def __init__(self, retry_after: float, body: str) -> None:
        super().__init__(f"HTTP 429 (retry after {retry_after:g} s): {body[:200]}")
        self.retry_after, self.body = retry_after, body


def _error_message(r: httpx.Response) -> str:
    try:
        message = error_message(r.json())
    except ValueError:
        message = None
    return message or r.text[:300] or f"HTTP {r.status_code}"


class ChunkedStream(tts.ChunkedStream):
    """Non-streaming synthesis of one text (still streamed from the engine as it is made)."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)
        self.report = SentenceReport(input_text)
        self.attempts = 0  # LiveKit's base class calls _run once per attempt (1 + retries)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=SAMPLE_RATE,
                                  num_channels=1, mime_type="audio/pcm")  # fmt: skip
        self.attempts += 1
        first = self.attempts == 1
        report = self.report = SentenceReport(self.input_text)
        # A retry (LiveKit's, after every endpoint failed) is one more try, not another round
        # of failovers; once audio has played, a cut is continued on the next endpoint.
        async with self._tts._pool.in_use():
            await self._tts._speak(self._opts, report, output_emitter.push, lambda: None,
                                   self._conn_options,
                                   fail_over=lambda: first or report.delivered_bytes > 0)  # fmt: skip

    async def aclose(self) -> None:
        self._tts._streams.discard(self)
        await super().aclose()


class SynthesizeStream(tts.SynthesizeStream):
    """The LLM's text as it comes: each segment (up to a `flush()`) goes to the engine over one
    streaming-text socket, or as sentence requests (`text_input`, and what the engine takes)."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)
        self.sentences: list[SentenceReport] = []  # of the last attempt, segments sent as sentences
        self.text_streams: list[TextStreamReport] = []  # of the last attempt, segments streamed
        self.attempts = 0  # LiveKit's base class calls _run once per attempt (1 + retries)
        self._played = False  # this attempt has pushed audio

    async def aclose(self) -> None:
        self._tts._streams.discard(self)
        await super().aclose()

    def _may_fail_over(self) -> bool:
        """A retry makes one try per request until audio has played (as `ChunkedStream`)."""
        return self.attempts == 1 or self._played

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=SAMPLE_RATE,
                                  num_channels=1, mime_type="audio/pcm", stream=True)  # fmt: skip
        self.attempts += 1
        self._played = False
        self.sentences, self.text_streams = [], []
        segments: utils.aio.Chan[SegmentText] = utils.aio.Chan()

        async def split_input() -> None:
            text = None
            async for item in self._input_ch:
                if isinstance(item, self._FlushSentinel):
                    if text is not None:
                        text.end()
                    text = None
                    continue
                if text is None:
                    text = SegmentText()
                    segments.send_nowait(text)
                text.append(item)
            if text is not None:
                text.end()
            segments.close()

        async def speak_segments() -> None:
            async for text in segments:
                output_emitter.start_segment(segment_id=utils.shortuuid())
                await self._speak_text(text, output_emitter)
                output_emitter.end_segment()

        async with self._tts._pool.in_use():
            tasks = [asyncio.create_task(split_input()), asyncio.create_task(speak_segments())]
            try:
                await asyncio.gather(*tasks)
            finally:
                await utils.aio.cancel_and_wait(*tasks)

    async def _speak_text(self, text: SegmentText, emitter: tts.AudioEmitter) -> None:
        """One segment: over a socket where the engine takes streamed text, else as sentences."""
        if self._opts.streams_text() is not False:
            if not await text.has_words():
                return  # nothing to say: no socket (the sentence path requests nothing either)
            report = TextStreamReport()

            def deliver(data: bytes) -> None:
                emitter.push(data)
                self._played = True

            socket = self._tts._text_socket(self._opts, self._conn_options, deliver,
                                            self._mark_started, self._may_fail_over)  # fmt: skip
            try:
                self.text_streams.append(report)
                await socket.speak(text, report)
                return
            except NoTextStreaming:
                self.text_streams.remove(report)
        await self._speak_sentences(text, emitter)

    async def _speak_sentences(self, text: SegmentText, emitter: tts.AudioEmitter) -> None:
        sentences = FirstClauseTokenizer(
            self._tts._tokenizer, min_words=self._opts.first_clause_min_words
        ).stream()

        async def forward() -> None:
            async for batch in text.read():
                for piece in batch:
                    sentences.push_text(piece)
            sentences.end_input()

        forwarder = asyncio.create_task(forward())
        try:
            await self._speak_segment(sentences, emitter)
            await forwarder
        finally:
            await utils.aio.cancel_and_wait(forwarder)
            await sentences.aclose()

    async def _speak_segment(self, sentences: tokenize.SentenceStream, emitter) -> None:
        """Request up to `prefetch` sentences ahead; play their audio strictly in text order.
        The first "sentence" may be the segment's first clause: it gets the small first chunk."""
        slots = asyncio.Semaphore(1 + self._opts.prefetch)
        order: asyncio.Queue[tuple[SentenceReport, asyncio.Queue, asyncio.Task] | None] = (
            asyncio.Queue()
        )
        started: list[asyncio.Task] = []

        async def launch() -> None:
            async for ev in sentences:
                text = ev.token.strip()
                if not has_speakable_text(text):  # the engine would refuse it (400)
                    continue
                await slots.acquire()
                report = SentenceReport(text)
                self.sentences.append(report)
                audio: asyncio.Queue[bytes | None] = asyncio.Queue()
                ahead = started[-1] if started else None
                opts = self._opts.for_request(len(started))
                task = asyncio.create_task(self._fetch(opts, report, audio, ahead))
                started.append(task)
                order.put_nowait((report, audio, task))
            order.put_nowait(None)

        launcher = asyncio.create_task(launch())
        try:
            while (item := await order.get()) is not None:
                _report, audio, task = item
                while (data := await audio.get()) is not None:
                    emitter.push(data)
                    self._played = True
                await task  # raises the sentence's error, if any
                slots.release()
            await launcher
        finally:
            await utils.aio.cancel_and_wait(launcher, *started)

    async def _fetch(
        self, opts: _TTSOptions, report: SentenceReport, audio: asyncio.Queue,
        ahead: asyncio.Task | None,
    ) -> None:  # fmt: skip
        try:
            await self._tts._speak(opts, report, audio.put_nowait, self._mark_started,
                                   self._conn_options, ahead, self._may_fail_over)  # fmt: skip
        finally:
            audio.put_nowait(None)
