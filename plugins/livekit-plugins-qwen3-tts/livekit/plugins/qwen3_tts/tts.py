"""LiveKit TTS for Qwen3-TTS engines (ours on MLX, or vLLM-Omni on GPUs) over streaming HTTP,
or over a streaming-text WebSocket in either's dialect (`text_input`; `text_socket.py`).
Every utterance, either way, goes from engine to engine by one loop (`failover.py`).

In sentence mode, text from the LLM is cut into sentences; each is synthesized as soon as it is complete, while the
previous one still plays, so the prefill of sentence N+1 hides behind the audio of sentence N.
A reply's first clause goes ahead on its own, with a small first chunk (`clauses.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp
import httpx
from livekit.agents import (
    APIConnectOptions,
    APIError,
    tokenize,
    tts,
    utils,
)
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given

from . import failover
from .clauses import FirstClauseTokenizer
from .endpoints import EndpointPool, check_strategy
from .fleet import Resolver
from .http_sentence import HttpSentenceAttempt, SentenceReport
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
    MSG_SESSION_START,
    OMNI_CONFIG,
    SAMPLE_RATE,
    SAMPLE_RATES,
    has_speakable_text,
    normalize_language,
)
from .segment_text import SegmentText, split_sentences
from .socket_pool import MAX_IDLE_S, SocketPool
from .text_socket import NoTextStreaming, SocketAttempt, TextStreamReport

_Piece = TypeVar("_Piece", str, SegmentText)  # what a segment is spoken in: sentences, utterances

DEFAULT_URL = "http://127.0.0.1:8880"
# The owned HTTP client's default, which bounds the `/ready` probes: a healthy engine answers at
# once. Synthesis requests are bounded by `conn_options.timeout` alone.
DEFAULT_TIMEOUT = httpx.Timeout(2.0)
_TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
# what the warning says of an utterance that did not end by end of speech
_ENDINGS = {"length": "ran to its frame cap instead of ending by itself",
            "repetition": "was ended by the engine's loop detector (repeating audio)",
            "abort": "was aborted by the engine", "error": "failed in the engine"}  # fmt: skip


@dataclass(frozen=True)
class Ending:
    """Why one utterance ended (`protocol.finish_reason`): what a TTS's `"finish_reason"`
    event carries, once per utterance (a sentence request, a streamed utterance)."""

    reason: str  # stop | length | repetition | abort | error (or a newer engine's word)
    text: str
    endpoint: str | None
    request_id: str | None = None


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
    sample_rate: int = SAMPLE_RATE  # of the audio asked for (the engine resamples)
    protocols: tuple[str, ...] = ()  # one per base URL where they differ (else all `protocol`)

    def dialects(self) -> tuple[str, ...]:
        """The protocols in use (each endpoint's, `Endpoint.protocol`)."""
        return tuple(dict.fromkeys(self.protocols or (self.protocol,)))

    def __post_init__(self) -> None:  # also checks what update_options() changes
        if self.first_chunk_frames not in (1, 2, 4):
            raise ValueError("first_chunk_frames must be 1, 2 or 4")
        if self.prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        if any(p not in ("qwen3-tts", "vllm-omni") for p in (self.protocol, *self.protocols)):
            raise ValueError("protocol must be 'qwen3-tts' or 'vllm-omni' (or a list of them, "
                             "one per base URL)")  # fmt: skip
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
        if self.sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}, "
                             f"not {self.sample_rate!r}")  # fmt: skip
        if self.sample_rate != SAMPLE_RATE and "vllm-omni" in self.dialects():
            raise ValueError(f"sample_rate={self.sample_rate} needs protocol='qwen3-tts' "
                             f"(vLLM-Omni sends {SAMPLE_RATE} Hz)")  # fmt: skip
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
        """Whether a stream's segments go over the streaming-text socket: None: ask the engine
        (its status; vLLM-Omni's upgrade)."""
        if self.text_input == "sentences":
            return False
        return True if self.text_input == "stream" else None

    def stream_start(self, seed: int, index: int = 0) -> dict:
        """The `session.start` message of a segment's `index`-th streamed utterance: the fields
        of a request; the first asks for the small first chunk of a reply's first request when
        one is set (never larger than `first_chunk_frames`)."""
        body = self._stream_body(seed, index, "qwen3-tts")
        return {"type": MSG_SESSION_START, **body}

    def stream_config(self, seed: int, index: int = 0) -> dict:
        """vLLM-Omni's `session.config` for the same utterance: its own fields, the seed (so a
        failover between dialects repeats the same audio), PCM streamed as it is made."""
        body = self._stream_body(seed, index, "vllm-omni")
        return {"type": OMNI_CONFIG, **body, "seed": seed, "stream_audio": True,
                "initial_codec_chunk_frames": body.pop("first_chunk_frames")}  # fmt: skip

    def stream_starts(self, seed: int, index: int = 0) -> dict[str, dict]:
        """The opening message of the utterance in each dialect in use."""
        make = {"qwen3-tts": self.stream_start, "vllm-omni": self.stream_config}
        return {p: make[p](seed, index) for p in self.dialects()}

    def _stream_body(self, seed: int, index: int, protocol: str) -> dict:
        frames = self.first_chunk_frames
        if index == 0:
            frames = min(self.first_clause_chunk_frames or frames, frames)
        body = replace(self, first_chunk_frames=frames).request_body("", seed, protocol)
        del body["input"], body["stream"]
        body.setdefault("first_chunk_frames", frames)
        return body

    def request_bodies(self, text: str, seed: int | None) -> dict[str, dict]:
        """One sentence's JSON in each protocol in use."""
        return {p: self.request_body(text, seed, p) for p in self.dialects()}

    def request_body(self, text: str, seed: int | None, protocol: str | None = None) -> dict:
        """The JSON for one sentence. vLLM-Omni gets only the fields it defines."""
        body = {
            "model": self.model, "input": text, "voice": self.voice, "response_format": "pcm",
            "stream": True, "language": self.language.capitalize(),
            "task_type": _TASK_TYPES.get(self.task_type) if self.task_type else None,
            "instructions": self.instructions, "ref_audio": self.ref_audio,
            "ref_text": self.ref_text, "max_new_tokens": self.max_new_tokens,
        }  # fmt: skip
        if (protocol or self.protocol) == "qwen3-tts":
            body.update(
                variant=self.variant, temperature=self.temperature, top_k=self.top_k,
                top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=seed,
                first_chunk_frames=self.first_chunk_frames,
                sample_rate=self.sample_rate if self.sample_rate != SAMPLE_RATE else None,
            )  # fmt: skip
        return {k: v for k, v in body.items() if v is not None}


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
        protocol: Protocol | list[Protocol] = "qwen3-tts",
        text_input: TextInput = "auto",
        sample_rate: int = SAMPLE_RATE,
        prefetch: int = 1,
        strategy: Strategy = "balanced",
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        probe_interval: float = 2.0,
        load_interval: float = 0.5,
        resolve_interval: float = 10.0,
        resolver: Resolver | None = None,
        tokenizer: tokenize.SentenceTokenizer | None = None,
        http_client: httpx.AsyncClient | None = None,
        socket_max_idle: float = MAX_IDLE_S,
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
        `protocol="vllm-omni"` for a vLLM-Omni server (only its own fields are sent; streamed
        text in its socket dialect), or a list, one protocol per `base_url`.
        `text_input` says how a stream's text reaches the engine: `"stream"` as the LLM writes it,
        over the engine's streaming-text WebSocket in the endpoint's dialect (one socket kept
        open from reply to reply, opened by `prewarm()`: see docs/plugins.md); `"sentences"`
        as one HTTP request per sentence (below); `"auto"` streams where the engine's status says
        `streaming_text` (read once per endpoint; a vLLM-Omni endpoint: where its socket's
        upgrade succeeds) and sends sentences elsewhere (older engines). `synthesize()` always
        makes one HTTP request.
        `max_new_tokens` caps each sentence's frames on either path (under it a streamed segment
        is one socket utterance per sentence: the engine caps an utterance as a whole).
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
        `sample_rate` (8000, 16000, 24000 or 48000; fixed for the TTS's life) is the rate the
        engine is asked to send (it resamples from its 24 kHz) and this TTS's `sample_rate`:
        16000 or 8000 for a phone call saves LiveKit resampling every frame (qwen3-tts only).
        `socket_max_idle` (s): a warm socket that waited this long for an utterance is closed by
        the plugin (keep it below the engine's `ws_keepalive_timeout_s`, 300 s by default).
        """
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True),
            sample_rate=sample_rate,
            num_channels=1,
        )
        urls = base_url or os.environ.get("QWEN3_TTS_URL", DEFAULT_URL)
        urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls)
        protocols: tuple[str, ...] = ()
        if not isinstance(protocol, str):  # one per base URL
            protocols = tuple(protocol)
            if len(protocols) != len(urls):
                raise ValueError(f"{len(protocols)} protocols for {len(urls)} base URLs: give "
                                 "one protocol, or one per URL")  # fmt: skip
            protocol = protocols[0]
        self._opts = _TTSOptions(
            model=model, voice=voice, language=normalize_language(language),
            instructions=instructions, ref_audio=ref_audio, ref_text=ref_text,
            task_type=task_type, variant=variant, temperature=temperature, top_k=top_k,
            top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
            max_new_tokens=max_new_tokens, first_chunk_frames=first_chunk_frames,
            protocol=protocol, prefetch=prefetch, first_clause_min_words=first_clause_min_words,
            first_clause_chunk_frames=first_clause_chunk_frames, text_input=text_input,
            sample_rate=sample_rate, protocols=protocols,
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
                                  resolver=resolver, headers=self._headers,
                                  protocols=list(protocols or [protocol] * len(urls)))  # fmt: skip
        self._ws_session: aiohttp.ClientSession | None = None  # made when first needed
        if not socket_max_idle > 0:
            raise ValueError(f"socket_max_idle must be > 0 seconds, not {socket_max_idle!r}")
        self._sockets = SocketPool(self._ws_http, self._headers, max_idle_s=socket_max_idle)
        self._tokenizer = tokenizer or tokenize.basic.SentenceTokenizer()
        self._streams: weakref.WeakSet[ChunkedStream | SynthesizeStream] = weakref.WeakSet()
        # utterances by why they ended; LiveKit's TTSMetrics has no field for it: the agent
        # counts the `"finish_reason"` events (docs/plugins.md)
        self.finish_reasons: Counter[str] = Counter()
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

    @property
    def sockets(self) -> SocketPool:
        """The warm streaming-text sockets (one per endpoint in use, kept between replies)."""
        return self._sockets

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
        """Probe the endpoints, and open the streaming-text socket to the one a reply would go to
        now (LiveKit's AgentSession calls this as the session starts): the first reply finds it
        open."""
        self._pool.prewarm()
        if not self._closed and self._opts.streams_text() is not False:
            self._sockets.prewarm(self._pool, ask_engine=self._opts.streams_text() is None)

    async def aclose(self) -> None:
        """Close every stream still open (their requests and prefetches end), stop probing and
        close the owned HTTP client. Later `synthesize()`/`stream()` calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(s.aclose() for s in list(self._streams)), return_exceptions=True)
        await self._sockets.aclose()
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

    def _finished(self, report: SentenceReport | TextStreamReport) -> None:
        """An utterance was spoken: count why it ended, warn where it was not end of speech, and
        emit `"finish_reason"` with an `Ending`."""
        reason = report.finish_reason
        if reason is None:
            return
        request_id = getattr(report, "request_ids", None) or [None]
        ending = Ending(reason=reason, text=report.text, request_id=request_id[-1],
                        endpoint=report.endpoints[-1] if report.endpoints else None)  # fmt: skip
        self.finish_reasons[reason] += 1
        if reason != "stop":
            logger.warning("TTS utterance %s at %s %s (finish_reason=%s): %r",
                           ending.request_id or "", ending.endpoint,
                           _ENDINGS.get(reason, "ended"), reason, report.text[:60])  # fmt: skip
        self.emit("finish_reason", ending)

    # -- one utterance on one transport (`failover.speak` tries it from engine to engine) -----

    def _sentence_attempt(
        self, opts: _TTSOptions, report: SentenceReport, deliver: Callable[[bytes], None],
        on_sent: Callable[[], None], conn: APIConnectOptions, ahead: asyncio.Future | None = None,
    ) -> HttpSentenceAttempt:  # fmt: skip
        """One sentence over HTTP, with a seed of its own (sent on every try: a failover repeats
        the same audio, and the bytes already played are skipped)."""
        seed = opts.seed if opts.seed is not None else random.randrange(2**31)
        report.seed, report.first_chunk_frames = seed, opts.first_chunk_frames
        return HttpSentenceAttempt(pool=self._pool, client=self._client, headers=self._headers,
                                   bodies=opts.request_bodies(report.text, seed), report=report,
                                   deliver=deliver, on_sent=on_sent, conn=conn, ahead=ahead)  # fmt: skip

    def _socket_attempt(
        self, opts: _TTSOptions, index: int, text: SegmentText, report: TextStreamReport,
        deliver: Callable[[bytes], None], on_sent: Callable[[], None], conn: APIConnectOptions,
    ) -> SocketAttempt:  # fmt: skip
        """A segment's `index`-th streamed utterance, with a seed of its own (for failover); the
        first may still fall back to sentences where its engine takes no streamed text."""
        seed = opts.seed if opts.seed is not None else random.randrange(2**31)
        return SocketAttempt(pool=self._pool, sockets=self._sockets,
                             starts=opts.stream_starts(seed, index), text=text, report=report,
                             conn=conn, deliver=deliver, on_sent=on_sent,
                             ask_engine=opts.streams_text() is None, may_fall_back=index == 0)  # fmt: skip


class ChunkedStream(tts.ChunkedStream):
    """Non-streaming synthesis of one text (still streamed from the engine as it is made)."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)
        self.report = SentenceReport(input_text)
        self.attempts = 0  # LiveKit's base class calls _run once per attempt (1 + retries)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._opts.sample_rate,
                                  num_channels=1, mime_type="audio/pcm")  # fmt: skip
        self.attempts += 1
        first = self.attempts == 1
        report = self.report = SentenceReport(self.input_text)
        # A retry (LiveKit's, after every endpoint failed) is one more try, not another round
        # of failovers; once audio has played, a cut is continued on the next endpoint.
        async with self._tts._pool.in_use():
            attempt = self._tts._sentence_attempt(self._opts, report, output_emitter.push,
                                                  lambda: None, self._conn_options)  # fmt: skip
            await failover.speak(self._tts._pool, attempt,
                                 may_fail_over=lambda: first or report.delivered_bytes > 0)  # fmt: skip
        self._tts._finished(report)

    async def aclose(self) -> None:
        self._tts._streams.discard(self)
        await super().aclose()


class SynthesizeStream(tts.SynthesizeStream):
    """The LLM's text as it comes: each segment (up to a `flush()`) goes to the engine over the
    streaming-text socket, or as sentence requests (`text_input`, and what the engine takes).
    A streamed segment is one utterance, or one per sentence under `max_new_tokens` (a cap of
    each sentence on either path: the engine caps a socket's utterance as a whole)."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)
        self.sentences: list[SentenceReport] = []  # of the last attempt, requests of sentences
        self.text_streams: list[TextStreamReport] = []  # of the last attempt, streamed utterances
        self.attempts = 0  # LiveKit's base class calls _run once per attempt (1 + retries)
        self._played = False  # this attempt has pushed audio

    async def aclose(self) -> None:
        self._tts._streams.discard(self)
        await super().aclose()

    def _may_fail_over(self) -> bool:
        """A retry makes one try per request until audio has played (as `ChunkedStream`)."""
        return self.attempts == 1 or self._played

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._opts.sample_rate,
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
        """One segment: over sockets where the engine takes streamed text, else as sentences."""
        if self._opts.streams_text() is not False:
            if not await text.has_words():
                return  # nothing to say: no socket (the sentence path requests nothing either)
            streamed = len(self.text_streams)
            try:
                await self._speak_streamed(text, emitter)
                return
            except NoTextStreaming:
                del self.text_streams[streamed:]
        await self._speak_sentences(text, emitter)

    async def _speak_streamed(self, text: SegmentText, emitter: tts.AudioEmitter) -> None:
        """The segment as one utterance; under `max_new_tokens`, one per sentence (each sentence
        capped, as on the sentence path), each streamed as its text comes."""
        utterances: utils.aio.Chan[SegmentText] = utils.aio.Chan()
        splitter: asyncio.Task | None = None
        if self._opts.max_new_tokens is None:
            utterances.send_nowait(text)
            utterances.close()
        else:

            async def split() -> None:
                try:
                    await split_sentences(
                        text, self._tts._tokenizer.tokenize, utterances.send_nowait
                    )
                finally:
                    utterances.close()

            splitter = asyncio.create_task(split(), name="qwen3-tts-sentences")

        async def with_words() -> AsyncIterator[SegmentText]:
            async for utterance in utterances:
                if await utterance.has_words():
                    yield utterance

        try:
            await self._play_in_order(with_words(), self._speak_utterance, emitter)
            if splitter is not None:
                await splitter  # raises the tokenizer's error, if any
        finally:
            if splitter is not None:
                await utils.aio.cancel_and_wait(splitter)

    async def _speak_utterance(
        self, index: int, text: SegmentText, deliver: Callable[[bytes], None],
        ahead: asyncio.Task | None,  # an engine serves sockets side by side: no queue to excuse
    ) -> None:  # fmt: skip
        report = TextStreamReport()
        self.text_streams.append(report)
        attempt = self._tts._socket_attempt(self._opts, index, text, report, deliver,
                                            self._mark_started, self._conn_options)  # fmt: skip
        await failover.speak(self._tts._pool, attempt, may_fail_over=self._may_fail_over)
        self._tts._finished(report)
        if not report.ended_early:
            return
        # Only a frame cap (or the engine's loop detector) ends an utterance before its text:
        # under `max_new_tokens` that is a sentence's (the rest of the segment is the next
        # sentences'); without it, the engine's own limit, and the words it did not get are not
        # dropped silently.
        if self._opts.max_new_tokens is None:
            raise APIError(f"Qwen3-TTS ended a streamed utterance after {report.samples} samples "
                           f"before its text was all in (finish_reason={report.finish_reason}); "
                           f"{len(report.text)} characters were sent", retryable=False)  # fmt: skip
        logger.info("TTS sentence capped at max_new_tokens=%d frames before its text was all in "
                    "(%d characters sent)", self._opts.max_new_tokens, len(report.text))  # fmt: skip

    async def _speak_sentences(self, text: SegmentText, emitter: tts.AudioEmitter) -> None:
        sentences = FirstClauseTokenizer(
            self._tts._tokenizer, min_words=self._opts.first_clause_min_words
        ).stream()

        async def forward() -> None:
            async for batch in text.read():
                for piece in batch:
                    sentences.push_text(piece)
            sentences.end_input()

        async def speakable() -> AsyncIterator[str]:
            async for ev in sentences:
                text = ev.token.strip()
                if has_speakable_text(text):  # the engine would refuse it (400)
                    yield text

        forwarder = asyncio.create_task(forward())
        try:
            await self._play_in_order(speakable(), self._speak_sentence, emitter)
            await forwarder
        finally:
            await utils.aio.cancel_and_wait(forwarder)
            await sentences.aclose()

    async def _speak_sentence(
        self, index: int, text: str, deliver: Callable[[bytes], None], ahead: asyncio.Task | None
    ) -> None:  # fmt: skip
        """A segment's `index`-th request; the first may be its first clause (the small first
        chunk)."""
        report = SentenceReport(text)
        self.sentences.append(report)
        attempt = self._tts._sentence_attempt(self._opts.for_request(index), report, deliver,
                                              self._mark_started, self._conn_options, ahead)  # fmt: skip
        await failover.speak(self._tts._pool, attempt, may_fail_over=self._may_fail_over)
        self._tts._finished(report)

    async def _play_in_order(
        self, pieces: AsyncIterator[_Piece],
        speak: Callable[[int, _Piece, Callable[[bytes], None], asyncio.Task | None], Awaitable[None]],
        emitter: tts.AudioEmitter,
    ) -> None:  # fmt: skip
        """Speak `pieces` (a segment's sentences, or its streamed utterances) up to `prefetch`
        ahead of the one playing; play their audio strictly in order. `speak(index, piece,
        deliver, ahead)`: `ahead` is the piece's before it (a request queued behind it)."""
        slots = asyncio.Semaphore(1 + self._opts.prefetch)
        order: asyncio.Queue[tuple[asyncio.Queue, asyncio.Task] | None] = asyncio.Queue()
        started: list[asyncio.Task] = []

        async def fetch(index: int, piece: _Piece, audio: asyncio.Queue, ahead) -> None:
            try:
                await speak(index, piece, audio.put_nowait, ahead)
            finally:
                audio.put_nowait(None)

        async def launch() -> None:
            try:
                async with contextlib.aclosing(pieces):
                    async for piece in pieces:
                        await slots.acquire()
                        audio: asyncio.Queue[bytes | None] = asyncio.Queue()
                        ahead = started[-1] if started else None
                        task = asyncio.create_task(fetch(len(started), piece, audio, ahead))
                        started.append(task)
                        order.put_nowait((audio, task))
            finally:  # also when reading the pieces failed: `await launcher` raises it
                order.put_nowait(None)

        launcher = asyncio.create_task(launch())
        try:
            while (item := await order.get()) is not None:
                audio, task = item
                while (data := await audio.get()) is not None:
                    emitter.push(data)
                    self._played = True
                await task  # raises the piece's error, if any
                slots.release()
            await launcher
        finally:
            await utils.aio.cancel_and_wait(launcher, *started)
