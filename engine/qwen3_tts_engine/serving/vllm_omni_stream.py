"""vLLM-Omni's streaming-text socket dialect at `GET /v1/audio/speech/stream` (an upgrade without
the engine's own subprotocol), so its clients (LiveKit's `baseten.TTS(model="qwen3-tts")`, SGLang-
Omni's) change only the URL; on the session core (`socket_session.py`).

The client sends `session.config` (sticky, replaceable between flushes), `input.text` pieces,
`input.done` (a flush: `session.done`, the socket stays open; an empty one answers at once with
zero sentences) and `session.close`. The server answers per sentence `audio.start`, binary PCM
(or one binary frame in `response_format` when `stream_audio` is false) and `audio.done`, then
`session.done` per flush, as vLLM-Omni words them (its streaming speech handler, package
`vllm-omni` 0.30.0). Unlike vLLM-Omni, the text reaches the talker as it arrives: a
sentence's synthesis starts with its first text. docs/engine-api.md lists each config field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from qwen3_tts_engine.audio import encode_whole
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import CHUNK_FRAMES, RESPONSE_FORMATS, RequestError
from qwen3_tts_engine.serving.session_core import SPLITS, Backlog, split_parts
from qwen3_tts_engine.serving.socket_session import SocketHub, SocketSession, Utterance

PROTOCOL = "vllm_omni"
MAX_CONFIG_FIELDS = 64
# session.config's fields the engine honours -> the POST field each becomes ("speaker" is
# vLLM-Omni's alias of voice; initial_codec_chunk_frames is mapped by `_first_chunk_frames`)
CONFIG_FIELDS = {"model": "model", "voice": "voice", "speaker": "voice", "task_type": "task_type",
                 "language": "language", "instructions": "instructions", "speed": "speed",
                 "max_new_tokens": "max_new_tokens", "ref_audio": "ref_audio",
                 "ref_text": "ref_text", "seed": "seed"}  # fmt: skip
# the session's own (not POST's): how text is cut into sentences and how audio is sent
SESSION_FIELDS = ("response_format", "stream_audio", "split_granularity",
                  "initial_codec_chunk_frames")  # fmt: skip
# accepted and ignored: prompt construction (this engine always streams the text, dual-track)
# and the timestamp strategy that only matters with word_timestamps (refused when true)
IGNORED_FIELDS = ("non_streaming_mode", "timestamp_type", "timestamp_transport_strategy")
# refused when set: what this engine cannot do
REFUSED_FIELDS = {"x_vector_only_mode": "x_vector_only_mode (a speaker embedding alone) is not "
                                        "supported: send ref_audio with ref_text",
                  "speaker_embedding": "speaker_embedding is not supported: send ref_audio",
                  "word_timestamps": "word_timestamps=true needs a forced aligner, which this "
                                     "engine does not have"}  # fmt: skip


def _first_chunk_frames(value: object) -> int | None:
    """vLLM-Omni's `initial_codec_chunk_frames` (any count; 0 or none: the default) as the
    engine's `first_chunk_frames` (1, 2 or 4): the largest of those not above it."""
    if value is None or value == 0:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError("initial_codec_chunk_frames must be an integer >= 0",
                           param="initial_codec_chunk_frames")  # fmt: skip
    return max(f for f in (1, 2, CHUNK_FRAMES) if f <= max(value, 1))


@dataclass
class Config:
    """One `session.config`: the POST fields of each sentence and how the session sends audio."""

    fields: dict = field(default_factory=dict)
    response_format: str = "wav"  # vLLM-Omni's default
    stream_audio: bool = False
    split: str = "none"


def parse_config(body: dict, prepare) -> Config:
    """A `session.config` message as vLLM-Omni reads it (`protocol/audio.py`'s
    StreamingSpeechSessionConfig); `prepare` (the service's) refuses a bad POST field now."""
    if len(body) > MAX_CONFIG_FIELDS:
        raise RequestError(f"session.config has {len(body)} fields; at most {MAX_CONFIG_FIELDS}")
    for name, why in REFUSED_FIELDS.items():
        if body.get(name):
            raise RequestError(f"Invalid session config: {why}", param=name)
    fmt = body.get("response_format", "wav")
    if fmt not in RESPONSE_FORMATS:
        raise RequestError(f"Invalid session config: response_format must be one of "
                           f"{', '.join(RESPONSE_FORMATS)}", param="response_format")  # fmt: skip
    stream_audio = body.get("stream_audio", False)
    if not isinstance(stream_audio, bool):
        raise RequestError("Invalid session config: stream_audio is true or false",
                           param="stream_audio")  # fmt: skip
    if stream_audio and fmt != "pcm":
        raise RequestError("WebSocket streaming audio (stream_audio=true) requires "
                           f"response_format='pcm'. Got response_format='{fmt}'.",
                           param="response_format")  # fmt: skip
    split = body.get("split_granularity", "none")
    if split not in SPLITS:
        raise RequestError(f"Invalid session config: split_granularity must be one of "
                           f"{', '.join(SPLITS)}", param="split_granularity")  # fmt: skip
    fields = {CONFIG_FIELDS[k]: v for k, v in body.items() if k in CONFIG_FIELDS and v is not None}
    if (first := _first_chunk_frames(body.get("initial_codec_chunk_frames"))) is not None:
        fields["first_chunk_frames"] = first
    prepare({**fields, "response_format": "pcm"}, streamed=True)
    return Config(fields, fmt, stream_audio, split)


@dataclass
class Sentence:
    """One unit of a flush (a sentence, a clause, or the whole flush's text): one synthesis."""

    text: TextInput
    config: Config
    utterance_index: int
    sentence_index: int
    audio: list[bytes] = field(default_factory=list)  # stream_audio false: held to its end
    bytes: int = 0


@dataclass
class FlushDone:
    """A flush's end, queued behind its sentences: `session.done` when its turn comes."""

    utterance_index: int
    total: int


class VllmOmniSession(SocketSession):
    """One socket of vLLM-Omni's dialect: its sticky config, its sentences spoken in turn."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.cfg: Config | None = None
        # sentences and flush ends in order, not yet begun (`backlog.open`: the sentence whose
        # text still arrives, begun or not)
        self.backlog: Backlog[Sentence] = Backlog(self.limits.max_pending, self.config.limits)
        self.flush_index = 0  # utterance_index: the flushes so far
        self.in_flush = 0  # sentences of the current flush so far
        self.flush_open = False  # text came since the last input.done
        self.speaking: Sentence | None = None
        self.last_reason = "stop"
        self.finishing = False

    def text_open(self) -> bool:
        return self.flush_open or super().text_open()

    # -- client messages ----------------------------------------------------------------------

    async def handle(self, body: dict) -> None:
        kind = body["type"]
        if kind == "session.config":
            if self.flush_open:
                raise RequestError("session.config cannot be applied while an utterance is in "
                                   "progress; send input.done first")  # fmt: skip
            fields = {k: v for k, v in body.items() if k != "type"}
            self.cfg = parse_config(fields, self.service.prepare)
        elif self.cfg is None:
            raise RequestError(f"Expected session.config, got: {kind[:64]}")
        elif self.finishing:
            raise RequestError(f"{kind[:64]} after session.close")
        elif kind == "input.text":
            await self._text(body.get("text", ""))
        elif kind == "input.done":
            await self._flush()
        elif kind == "session.close":
            await self._close()
        else:
            raise RequestError(f"Unknown message type: {kind[:64]}", param="type")

    def _sentence(self) -> Sentence:
        self.in_flush += 1
        return Sentence(TextInput(), self.cfg, self.flush_index, self.in_flush - 1)

    async def _text(self, text: object) -> None:
        text = self.check_piece(text if text is not None else "")
        self.flush_open = self.flush_open or bool(text)  # (vLLM-Omni's utterance_open)
        for part, ends in split_parts(text, self.cfg.split):
            self.backlog.add(part, ends, self._sentence)  # past ws_max_pending: joins the last
        await self._next()

    async def _flush(self) -> None:
        self.backlog.close_open()
        self.backlog.mark(FlushDone(self.flush_index, self.in_flush))
        self.flush_index += 1
        self.in_flush = 0
        self.flush_open = False
        await self._next()

    async def _close(self) -> None:
        """session.close: what was flushed is spoken, text not flushed is dropped (as vLLM-Omni
        does); then the server closes (1000)."""
        dropped = self.backlog.drop_open()
        utt = self.utterance
        if dropped is not None and dropped is self.speaking and await self.cancel():
            await self._sentence_done(dropped, utt)  # its audio.done says "abort"
        self.finishing = True
        await self._next()

    # -- the sentences in turn ----------------------------------------------------------------

    async def _next(self) -> None:
        """With no sentence speaking: the next one begins; flushes before it end."""
        utt = self.utterance
        if utt is not None and not utt.settled:
            return
        while (item := self.backlog.pop()) is not None:
            if isinstance(item, FlushDone):
                await self.send_json({"type": "session.done", "utterance_index": item.utterance_index,
                                      "total_sentences": item.total,
                                      "finish_reason": self.last_reason})  # fmt: skip
                self.last_reason = "stop"
                continue
            self.speaking = item
            await self.open_utterance({**item.config.fields, "response_format": "pcm"}, item.text)
            return
        if self.finishing and not self.closing:
            self.closing = True  # `run` closes with 1000

    async def after_utterance(self, utt: Utterance) -> None:
        await self._next()

    # -- server events ------------------------------------------------------------------------

    async def send_started(self, utt: Utterance) -> None:
        item = self.speaking
        start = {"type": "audio.start", "utterance_index": item.utterance_index,
                 "sentence_index": item.sentence_index, "sentence_text": item.text.text,
                 "format": item.config.response_format}  # fmt: skip
        if item.config.stream_audio:
            start["sample_rate"] = utt.req.sample_rate
        await self.send_json(start)

    async def send_audio(self, utt: Utterance, pcm: bytes) -> None:
        sentence = self.speaking
        sentence.bytes += len(pcm)
        if sentence.config.stream_audio:
            await self.send_bounded(pcm)
        else:
            sentence.audio.append(pcm)

    async def send_done(self, utt: Utterance) -> None:
        sentence = self.speaking
        cfg = sentence.config
        if not cfg.stream_audio:
            pcm = b"".join(sentence.audio)
            sentence.audio.clear()
            body = await asyncio.to_thread(encode_whole, pcm, cfg.response_format,
                                           utt.req.sample_rate)  # fmt: skip
            sentence.bytes = len(body)
            await self.send_bounded(body)
        await self._sentence_done(sentence, utt)

    async def _sentence_done(self, sentence: Sentence, utt: Utterance) -> None:
        if utt.finish_reason != "stop":
            self.last_reason = utt.finish_reason
        await self.send_json({"type": "audio.done", "utterance_index": sentence.utterance_index,
                              "sentence_index": sentence.sentence_index,
                              "total_bytes": sentence.bytes, "error": False,
                              "finish_reason": utt.finish_reason})  # fmt: skip

    def error_event(self, error: RequestError) -> dict:
        # vLLM-Omni's error is {"type", "message"}; the engine adds the status and code
        event = {"type": "error", "message": error.message, "status": error.status}
        if error.code:
            event["code"] = error.code
        if error.param:
            event["param"] = error.param
        return event


class VllmOmniRoutes:
    """The dialect's door: the engine's own route, an upgrade without its subprotocol."""

    def __init__(self, hub: SocketHub) -> None:
        self.hub = hub

    async def stream(self, request: web.Request) -> web.StreamResponse:
        return await self.hub.serve(request, VllmOmniSession, (), PROTOCOL)
