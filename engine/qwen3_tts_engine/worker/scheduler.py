"""Continuous batching: one talker step for every active stream of one loaded model.

Each step runs the talker once on a batched KV cache (mlx-lm's `BatchKVCache`: rows of
different lengths, left-padded, with explicit positions and mask), the code predictor once on
all rows, and samples every row with its own settings and random key (`sampling.py`). A stream
joins between steps: the sentences that start in a step are prefilled together (right-padded,
the padding then rolled to the left as mlx-lm's batched prompt processing does) and their cache
rows are added to the batch; it leaves on EOS, its frame cap, a cancel or an
error, and the others go on. Long input runs sentence by sentence: a row leaves at the end of a
sentence and its next sentence joins as a new prefill, into the same vocoder stream, so chunks
keep 4 frames across sentences. A stream whose consumer is behind is paused: its cache row is
taken out of the batch and merged back when it resumes.

A stream's text side is its `TextTrack` (`text_track.py`): the "prompt" layout, or dual-track
with one text token per frame. Text streamed in (`append_text`, `end_text`) starts once the
start threshold's worth of tokens is committed; a stream whose next token has not arrived
leaves the batch as a paused one does (its frame's codec embeddings kept) and rejoins when the
token comes, with the pending frames flushed so its audio catches up with its text.

Runs in the handler's worker process, on its main thread (mlx).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from qwen3_tts_engine.protocol import (
    CHUNK_FRAMES,
    DEFAULT_TEXT_START_TOKENS,
    Limits,
    SpeechRequest,
    default_max_new_tokens,
    speech_chars,
)
from qwen3_tts_engine.rules import ModelInfo, Voice, check_request, text_mode_for
from qwen3_tts_engine.sentences import split_input
from qwen3_tts_engine.worker.blas_threads import blas_threads, threads_for
from qwen3_tts_engine.worker.incremental_text import IncrementalText
from qwen3_tts_engine.worker.loading import describe
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES, LoopRules, loop_kind
from qwen3_tts_engine.worker.sampling import (
    BatchSampler,
    SamplingParams,
    eos_suppression,
    frame_uniforms,
    presence_mask,
)
from qwen3_tts_engine.worker.text_track import WAIT, TextTrack
from qwen3_tts_engine.worker.vocoder import decode_steps, new_stream


@dataclass
class Chunk:
    audio: np.ndarray  # float32 in [-1, 1]
    frames: int
    compute_s: float  # wall time spent on this chunk's frames and its vocoder step
    codes: np.ndarray | None = None  # [frames, 16] when requested


@dataclass
class SynthesisStats:
    frames: int = 0
    sentences: int = 0
    hit_token_cap: bool = False
    cancelled: bool = False
    chunk_frames: list[int] = field(default_factory=list)
    text_mode: str = "prompt"
    text_tokens: int = 0  # text tokens fed (dual-track)
    text_waits: int = 0  # times the stream left the batch to wait for streamed text
    repetitions: int = 0  # sentences the loop detector ended
    loop: str | None = None  # the loop detector's last rule that fired ("cycle", "stall")

    @property
    def finish_reason(self) -> str:
        """Why the stream ended (`protocol.FINISH_REASONS`): of several sentences, the worst
        ending of any: "repetition" (the loop detector) over "length" (a frame cap) over "stop"
        (end-of-speech); "abort" when it was cancelled. (A failed stream sends no stats.)"""
        if self.cancelled:
            return "abort"
        if self.repetitions:
            return "repetition"
        return "length" if self.hit_token_cap else "stop"


@dataclass
class Event:
    """What a step produced for one stream: a chunk, its end ("done"), or its failure."""

    stream: Stream
    kind: str  # "chunk" | "done" | "error"
    chunk: Chunk | None = None
    error: Exception | None = None


@dataclass
class Stream:
    id: str
    req: SpeechRequest
    voice: Voice
    ref_audio: mx.array | None
    params: SamplingParams
    key: mx.array
    keep_codes: bool = False
    decode: bool = True
    stats: SynthesisStats = field(default_factory=SynthesisStats)
    sentences: list[str] = field(default_factory=list)
    sentence: int = -1
    # the sentence in progress
    step: int = 0
    max_frames: int = 0
    history: list[int] = field(default_factory=list)
    mode: str = "prompt"  # the text layout (`protocol.TEXT_MODES`)
    feed: IncrementalText | None = None  # streamed text, tokenized as it comes
    feed_chars: int = 0  # streamed text: its `speech_chars` so far (its frame cap)
    text: TextTrack | None = None  # the sentence's text side
    next_embed: mx.array | None = None  # the talker's next input [1, 1, H]
    codec_next: mx.array | None = None  # its codec part while the text token is awaited
    parked: list | None = None  # its KV cache while out of the batch (paused)
    prefill: mx.array | None = None  # a new sentence's prompt embeddings [1, L, H]
    # chunking
    target: int = CHUNK_FRAMES
    pending: list[mx.array] = field(default_factory=list)
    vocoder: object | None = None
    chunk_started: float = field(default_factory=time.perf_counter)
    paused: bool = False
    waiting_text: bool = False  # out of the batch until its next text token arrives
    cancelled: bool = False
    error: Exception | None = None  # its own failure (`Scheduler.fail`): it ends with it
    finished: bool = False

    @property
    def idle(self) -> bool:
        """Nothing to compute until something arrives (the consumer, or text)."""
        if self.cancelled:
            return False
        if self.paused or self.waiting_text:
            return True
        return self.text is None and self.feed is not None and not self._can_start()

    def _can_start(self) -> bool:
        return self.feed.ended or len(self.feed.ids) >= (
            self.req.text_start_tokens or DEFAULT_TEXT_START_TOKENS
        )


def _new_key(seed: int | None) -> mx.array:
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    return mx.random.key(seed)


class Scheduler:
    """Streams of one model, advanced together one frame per `step()`."""

    def __init__(self, model, *, max_batch: int = 8, step_delay_s: float = 0.0,
                 loop_rules: LoopRules | None = DEFAULT_LOOP_RULES) -> None:  # fmt: skip
        if model.speech_tokenizer is None or model.tokenizer is None:
            raise RuntimeError("the checkpoint's tokenizer or speech tokenizer failed to load")
        self.model = model
        self.info = ModelInfo.from_info(describe(model))
        self.max_batch = max_batch
        self.step_delay_s = step_delay_s  # fault injection: sleep per stream per step (messages.py)
        self.loop_rules = loop_rules  # None: no loop detector (sentences end by EOS or their cap)
        self.talker = model.talker
        config = model.config.talker_config
        self.eos = config.codec_eos_token_id
        self.vocab = config.vocab_size
        self.code_vocab = model.config.talker_config.code_predictor_config.vocab_size
        self.groups = config.num_code_groups
        suppress = np.zeros(self.vocab, np.bool_)
        suppress[self.vocab - 1024 :] = True
        suppress[self.eos] = False
        self.suppress = mx.array(suppress)
        # the talker's steps on one BLAS thread where its matmuls are small (blas_threads.py)
        self.step_threads = threads_for(config.hidden_size * config.intermediate_size)
        self.streams: dict[str, Stream] = {}
        self.rows: list[Stream] = []  # the streams in the batch, in cache-row order
        self.cache: list[BatchKVCache] | None = None
        # recent steps: whole step, its talker + code predictor part, rows per step
        self.step_s: deque[float] = deque(maxlen=1024)
        self.codes_s: deque[float] = deque(maxlen=1024)
        self.batch_sizes: deque[int] = deque(maxlen=1024)
        # (rows, seconds) of each step not yet reported to the server (capacity, worker/main.py)
        self.step_log: list[tuple[int, float]] = []
        # streamed text: rows that left the batch to wait for it, and came back
        self.text_waits = 0
        self.text_resumes = 0
        self.limits_frames = Limits().max_new_tokens  # the cap of a stream whose text is open

    # -- streams -------------------------------------------------------------------------------

    def add(self, stream_id: str, req: SpeechRequest, *, ref_audio: mx.array | None = None,
            keep_codes: bool = False, decode: bool = True, split: bool = True,
            stats: SynthesisStats | None = None) -> Stream:  # fmt: skip
        """Admit a request (it starts at the next step); RequestError when it cannot be served.
        `split=False` prefills the whole input at once instead of sentence by sentence."""
        voice = check_request(req, self.info, ref_audio=ref_audio is not None)
        mode = text_mode_for(req, self.info)
        options = self.model._resolve_generation_options(
            req.temperature, None, req.top_k, req.top_p, req.repetition_penalty
        )
        penalty = options["repetition_penalty"]
        if ref_audio is not None and req.ref_text:
            penalty = max(penalty, 1.5)  # as mlx-audio's ICL path: long prefills degenerate
        params = SamplingParams(options["temperature"], options["top_k"], options["top_p"], penalty)
        # Sentence by sentence in the "prompt" layout (the prompt holds a sentence: first audio
        # does not wait for the rest); dual-track takes the text one token per frame anyway.
        sentences = (
            split_input(req.input)
            if split and mode == "prompt" and not req.text_stream
            else [req.input]
        )
        stream = Stream(stream_id, req, voice, ref_audio, params, _new_key(req.seed),
                        keep_codes=keep_codes, decode=decode,
                        stats=stats if stats is not None else SynthesisStats(),
                        sentences=sentences, mode=mode,
                        target=req.first_chunk_frames or CHUNK_FRAMES)  # fmt: skip
        stream.stats.text_mode = mode
        if req.text_stream:
            stream.feed = IncrementalText(self.model.tokenizer)
            if req.input:
                stream.feed.append(req.input)
                stream.feed_chars = speech_chars(req.input)
        self.streams[stream_id] = stream
        return stream

    def append_text(self, stream_id: str, text: str) -> int | None:
        """More of a streamed text; the text tokens committed so far (None: no such stream)."""
        s = self.streams.get(stream_id)
        if s is None or s.feed is None or s.feed.ended or s.error is not None:
            return None
        try:  # its tokenizer and embeddings: a failure here is this stream's, not the batch's
            count = s.text.append(text) if s.text is not None else len(s.feed.append(text))
            s.feed_chars += speech_chars(text)
            self._text_arrived(s)
        except Exception as e:
            self.fail(stream_id, e)
            return None
        return count if s.text is not None else len(s.feed.ids)

    def end_text(self, stream_id: str) -> int | None:
        """A streamed text is complete; the text tokens committed (None: no such stream)."""
        s = self.streams.get(stream_id)
        if s is None or s.feed is None or s.error is not None:
            return None
        try:  # as `append_text`: the held-back text is tokenized now
            if s.text is not None:
                s.text.end()
            else:
                s.feed.end()
            self._text_arrived(s)
        except Exception as e:
            self.fail(stream_id, e)
            return None
        return len(s.feed.ids)

    def _text_arrived(self, s: Stream) -> None:
        if s.text is not None and s.text.ended:  # its length is known now
            s.max_frames = self._cap(s)
        if s.waiting_text and s.text is not None:
            term = s.text.term(s.step - 1)
            if term is not WAIT:  # its token came: it rejoins the batch at the next step
                s.next_embed, s.codec_next, s.waiting_text = s.codec_next + term, None, False
                self.text_resumes += 1
                s.chunk_started = time.perf_counter()  # waiting is not compute

    def cancel(self, stream_id: str) -> None:
        if (stream := self.streams.get(stream_id)) is not None:
            stream.cancelled = True

    def fail(self, stream_id: str, error: Exception) -> None:
        """End a stream with its own `error` (an "error" event at the next step, as a cancel
        leaves: its row goes, the others go on)."""
        if (stream := self.streams.get(stream_id)) is not None and stream.error is None:
            stream.error, stream.cancelled = error, True

    def set_paused(self, stream_id: str, paused: bool) -> None:
        if (stream := self.streams.get(stream_id)) is not None and stream.paused != paused:
            stream.paused = paused
            if not paused:
                stream.chunk_started = time.perf_counter()  # waiting is not compute

    @property
    def runnable(self) -> bool:
        """True when a step would do work (some stream is neither paused, nor waiting for
        text, nor finished)."""
        return any(not s.idle for s in self.streams.values())

    def kv_bytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(c.nbytes for c in self.cache)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Advance every runnable stream by one frame; the chunks made and the streams ended."""
        t0 = time.perf_counter()
        events: list[Event] = []
        self._drop_rows(events)
        joining = self._admit(events)
        rows = self.rows + joining
        if not rows:
            return events
        with blas_threads(self.step_threads):
            logits, hidden = self._talker_step(joining)
            codes, codec_embeds, is_eos = self._codes(rows, logits, hidden)
            mx.eval(codes, codec_embeds, is_eos, *(s.key for s in rows))
        self.rows = rows
        self.codes_s.append(time.perf_counter() - t0)
        self.batch_sizes.append(len(rows))
        codes_np = np.array(codes)
        eos_np = np.array(is_eos)
        leaving, waiting, failed = [], [], []
        for i, s in enumerate(rows):
            try:
                if eos_np[i]:
                    leaving.append(i)
                    continue
                s.history.append(int(codes_np[i, 0]))
                s.pending.append(codes[i])
                s.step += 1
                s.stats.frames += 1
                if self._looping(s):
                    leaving.append(i)
                    continue
                if s.step >= s.max_frames:
                    s.stats.hit_token_cap = True
                    leaving.append(i)
                    continue
                term = s.text.term(s.step - 1)
                if term is WAIT:  # its next text token has not arrived: it waits out of the batch
                    s.codec_next, s.waiting_text = codec_embeds[i : i + 1], True
                    s.stats.text_waits += 1
                    self.text_waits += 1
                    waiting.append(i)
                else:
                    s.next_embed = codec_embeds[i : i + 1] + term
            except Exception as e:  # this row's own failure: it leaves, the others go on
                self._fail(s, e, events)
                failed.append(i)
        for i in waiting:
            rows[i].parked = [c.extract(i) for c in self.cache]
        for i in leaving:
            try:
                self._end_sentence(rows[i])  # its next sentence's text
            except Exception as e:
                self._fail(rows[i], e, events)
        if leaving or waiting or failed:
            gone = set(leaving) | set(waiting) | set(failed)
            self._filter([i for i in range(len(rows)) if i not in gone])
        self._flush(events)
        if self.step_delay_s:
            time.sleep(self.step_delay_s * len(rows))
        seconds = time.perf_counter() - t0
        self.step_s.append(seconds)
        self.step_log.append((len(rows), seconds))
        return events

    def _drop_rows(self, events: list[Event]) -> None:
        """Take cancelled and paused streams out of the batch (a paused one keeps its cache)."""
        keep = []
        for i, s in enumerate(self.rows):
            if s.cancelled:
                continue
            if s.paused:
                s.parked = [c.extract(i) for c in self.cache]
                continue
            keep.append(i)
        if len(keep) < len(self.rows):
            self._filter(keep)
        for s in [s for s in self.streams.values() if s.cancelled]:
            if s.error is not None:
                self._fail(s, s.error, events)
                continue
            s.stats.cancelled = True
            self._finish(s, events)

    def _admit(self, events: list[Event]) -> list[Stream]:
        """Streams that start a sentence this step (prefilled alone) and paused ones resuming."""
        joining: list[Stream] = []
        in_batch = {id(s) for s in self.rows}
        for s in list(self.streams.values()):
            if s.paused or s.waiting_text or s.finished or id(s) in in_batch:
                continue
            if s.feed is not None and s.text is None and not s._can_start():
                continue  # streamed text: not enough of it yet
            if len(self.rows) + len(joining) >= self.max_batch:
                break
            if s.parked is not None:  # resuming: its cache goes back in, it decodes with the rest
                self._merge(s.parked)
                s.parked = None
                self.rows.append(s)
                in_batch.add(id(s))
                continue
            try:
                if s.sentence < 0 and not self._next_sentence(s):
                    self._finish(s, events)
                    continue
                self._prompt(s)
            except Exception as e:  # this request's failure only
                self._fail(s, e, events)
                continue
            joining.append(s)
        return joining

    def _next_sentence(self, s: Stream) -> bool:
        s.sentence += 1
        if s.sentence >= len(s.sentences):
            return False
        s.stats.sentences += 1
        text = s.sentences[s.sentence]
        s.step, s.history = 0, []
        s.text = TextTrack(self.model, s.req, s.mode, text=None if s.feed else text, feed=s.feed)
        s.max_frames = self._cap(s, text)
        s.prefill = None
        return True

    def _cap(self, s: Stream, sentence: str = "") -> int:
        """The frame cap of the stream's sentence: the request's `max_new_tokens`, else the
        default from its text at the slowest speaking rate (`protocol.default_max_new_tokens`:
        of the sentence, or of all the streamed text). Streamed text still open gets the global
        cap: only `end_text` lets the text's own cap end the utterance (`_text_arrived`
        recomputes it from all the text then)."""
        if s.req.max_new_tokens:
            return s.req.max_new_tokens
        if s.feed is None:
            return default_max_new_tokens(sentence, s.req.instructions)
        if not s.feed.ended:
            return self.limits_frames  # open text: its length is not known yet
        return default_max_new_tokens(s.feed_chars, s.req.instructions)

    def _looping(self, s: Stream) -> bool:
        """Whether the loop detector ends the stream's sentence at this frame (it leaves as at
        its cap, and its next sentence, if any, starts)."""
        if self.loop_rules is None:
            return False
        kind = loop_kind(s.history, self.loop_rules, text_fed=s.text.eos_fed)
        if kind is None:
            return False
        s.stats.repetitions += 1
        s.stats.loop = kind
        return True

    def _prompt(self, s: Stream) -> None:
        """The prompt of the stream's sentence (prefilled at the step it joins)."""
        s.prefill = s.text.prompt(s.voice, s.ref_audio)

    def _talker_step(self, joining: list[Stream]) -> tuple[mx.array, mx.array]:
        """Logits [B, V] and hidden states [B, 1, H] of every row: the running rows decode one
        token together; the joining rows bring their prefill's last position."""
        logits, hidden = [], []
        running = self.rows
        if running:
            embeds = mx.concatenate([s.next_embed for s in running], axis=0)
            first = self.cache[0]
            positions = mx.broadcast_to(first.offset[None, :, None], (3, len(running), 1))
            mask = first.make_mask(1) if bool(mx.any(first.left_padding > 0).item()) else None
            lg, hd = self.talker(embeds, position_ids=positions, mask=mask, cache=self.cache)
            logits.append(lg[:, -1, :])
            hidden.append(hd)
        if joining:
            lg, hd = self._prefill_together(joining)
            logits.append(lg)
            hidden.append(hd)
        return mx.concatenate(logits, axis=0), mx.concatenate(hidden, axis=0)

    def _prefill_together(self, joining: list[Stream]) -> tuple[mx.array, mx.array]:
        """One talker pass over the prompts of the sentences that start now, right-padded to the
        longest; each row's logits and hidden state at its own last prompt position. The cache's
        padding is then rolled to the left (`BatchKVCache.finalize`) and the rows join the batch."""
        lengths = [s.prefill.shape[1] for s in joining]
        longest = max(lengths)
        embeds = mx.concatenate([mx.pad(s.prefill, [(0, 0), (0, longest - n), (0, 0)])
                                 for s, n in zip(joining, lengths, strict=True)], axis=0)  # fmt: skip
        cache = [BatchKVCache([0] * len(joining)) for _ in self.talker.model.layers]
        for c in cache:
            c.prepare(right_padding=[longest - n for n in lengths])
        positions = mx.broadcast_to(mx.arange(longest)[None, None], (3, len(joining), longest))
        hidden = self.talker.model(embeds, positions, None, cache)  # causal mask
        rows, last = mx.arange(len(joining)), mx.array(lengths) - 1
        hidden = hidden[rows, last][:, None, :]
        for c in cache:
            c.finalize()
        for s in joining:
            s.prefill = None
        self._extend(cache)
        # the codec head on each row's last position only, not on every prompt position
        # (a [rows x prompt, 3072] matmul: a quarter of a bfloat16 prefill on the CPU)
        return self.talker.codec_head(hidden)[:, -1, :], hidden

    def _codes(self, rows: list[Stream], logits: mx.array, hidden: mx.array):
        """Codebook 0 sampled from the talker, codebooks 1-15 from the code predictor, and
        each row's next talker input (its text position + the frame's codec embeddings)."""
        talker, predictor = self.talker, self.talker.code_predictor
        keys, uniforms = frame_uniforms([s.key for s in rows], self.groups)
        for s, key in zip(rows, keys, strict=True):
            s.key = key
        params = [s.params for s in rows]
        presence = presence_mask(
            [s.history if s.params.repetition_penalty != 1.0 else [] for s in rows], self.vocab
        )
        suppress = eos_suppression(self.suppress, self.eos,
                                   [s.text.eos_allowed(s.step) for s in rows])  # fmt: skip
        token = BatchSampler(params, self.vocab).sample(
            logits, uniforms[:, 0], suppress=suppress, presence=presence
        )
        code_sampler = BatchSampler(params, self.code_vocab)
        embed_codec = talker.get_input_embeddings()
        code_cache = predictor.make_cache()
        codes = [token]
        code_input = mx.concatenate([hidden, embed_codec(token)], axis=1)
        for group in range(self.groups - 1):
            if group > 0:
                code_input = predictor.codec_embedding[group - 1](codes[-1])
            code_logits, code_cache, _ = predictor(
                code_input, cache=code_cache, generation_step=group
            )
            codes.append(code_sampler.sample(code_logits[:, -1, :], uniforms[:, group + 1]))
        codec_embed = embed_codec(token)
        for i, code in enumerate(codes[1:]):
            codec_embed = codec_embed + predictor.codec_embedding[i](code)
        return mx.concatenate(codes, axis=1), codec_embed, token[:, 0] == self.eos

    # -- rows, sentences and chunks ------------------------------------------------------------

    def _merge(self, cache: list) -> None:
        """Add one stream's per-layer cache (plain or extracted) as the batch's last row."""
        self._extend([BatchKVCache.merge([c]) for c in cache])

    def _extend(self, cache: list[BatchKVCache]) -> None:
        if self.cache is None:
            self.cache = cache
        else:
            for mine, other in zip(self.cache, cache, strict=True):
                mine.extend(other)

    def _filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = None
            return
        index = mx.array(keep)
        for c in self.cache:
            c.filter(index)

    def _end_sentence(self, s: Stream) -> None:
        if not self._next_sentence(s):
            s.finished = True

    def _flush(self, events: list[Event]) -> None:
        """Decode the chunks that are complete (all at once where the vocoder allows)."""
        # a stream that waits for text sends what it has (its audio catches up with its text)
        ready = [s for s in self.streams.values()
                 if s.pending and (len(s.pending) >= s.target or s.finished or s.waiting_text)]  # fmt: skip
        decoding = [s for s in ready if s.decode]
        audio: dict[int, mx.array] = {}
        if decoding:
            items = []
            for s in decoding:
                if s.vocoder is None:
                    s.vocoder = new_stream(self.model.speech_tokenizer.decoder)
                items.append((s.vocoder, mx.stack(s.pending, axis=0).T[None]))  # [1, 16, n]
            for s, wav in zip(
                decoding, decode_steps(self.model.speech_tokenizer.decoder, items), strict=True
            ):
                audio[id(s)] = wav
            mx.eval(*audio.values())
        now = time.perf_counter()
        for s in ready:
            codes = np.array(mx.stack(s.pending, axis=0))
            wav = audio.get(id(s))
            samples = (
                np.array(wav.astype(mx.float32), copy=False)
                if wav is not None
                else np.zeros(0, np.float32)
            )
            events.append(Event(s, "chunk", Chunk(samples, len(s.pending), now - s.chunk_started,
                                                  codes if s.keep_codes or not s.decode else None)))  # fmt: skip
            s.stats.chunk_frames.append(len(s.pending))
            s.pending, s.target, s.chunk_started = [], CHUNK_FRAMES, now
        for s in [s for s in self.streams.values() if s.finished and not s.pending]:
            self._finish(s, events)

    def _finish(self, s: Stream, events: list[Event]) -> None:
        self.streams.pop(s.id, None)
        s.finished = True
        if s.text is not None:
            s.stats.text_tokens = len(s.text.fed_ids)
        events.append(Event(s, "done"))

    def _fail(self, s: Stream, error: Exception, events: list[Event]) -> None:
        self.streams.pop(s.id, None)
        s.finished = True
        events.append(Event(s, "error", error=error))
