"""The worker process: loads one model and runs mlx on this process's main thread.

mlx on a non-main thread fails or aborts at exit (docs/mlx-on-linux.md), so each handler owns
a spawned process (the server starts it by name: `dispatch/launch.py`). Its requests run
together on one model (`scheduler.py`): a request that arrives joins the batch at the next step.
The messages on its pipe are `messages.py`'s. A consumer that pauses pauses its stream only
(flow control, `messages.MAX_UNTAKEN`), and one that goes away leaves at most one chunk behind.
A stop ends the streams still running with an error.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from multiprocessing.connection import Connection

import mlx.core as mx
import numpy as np
import transformers  # noqa: F401  (mlx-audio loads the text tokenizer with it: a spare imports it early)
from mlx_audio.utils import load_audio

from qwen3_tts_engine import messages as msg
from qwen3_tts_engine.audio import pcm16
from qwen3_tts_engine.models.variants import resolve
from qwen3_tts_engine.priority import renice
from qwen3_tts_engine.protocol import FRAME_RATE, RequestError, SpeechRequest
from qwen3_tts_engine.worker.loading import describe, load, quantized_modules, release_freed_memory
from qwen3_tts_engine.worker.loop_detector import DEFAULT_LOOP_RULES
from qwen3_tts_engine.worker.measure import (
    kv_bytes_per_frame,
    model_bytes,
    process_memory,
    stream_layout,
)
from qwen3_tts_engine.worker.scheduler import Scheduler
from qwen3_tts_engine.worker.synthesis import stream_chunks

WARMUP_TEXT = "Hello, this is a warm-up."
REPORT_EVERY_S = 1.0  # how often a busy worker sends its batching stats
STEPS_EVERY_S = 0.25  # how often it sends its step times (admission reads them: capacity.py)


def _load_ref_audio(data: bytes) -> mx.array:
    """Decode reference audio (wav/flac/mp3 bytes) to a 24 kHz mx.array with mlx-audio."""
    with tempfile.NamedTemporaryFile(suffix=".audio") as f:
        f.write(data)
        f.flush()
        return load_audio(f.name, sample_rate=24000)


class _Live:
    """Bookkeeping of one stream in the worker: chunks sent and taken, timing."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.sent = 0
        self.taken = 0
        self.compute: list[float] = []
        self.peak_batch = 0
        self.tokens = 0  # streamed text: committed tokens last reported
        # the listener's playback, on this process's clock: it starts at the first chunk and
        # needs each next chunk when the audio sent before it has played
        self.first_audio: float | None = None
        self.audio_s = 0.0
        self.held = False  # paused by flow control since the last chunk (the consumer's doing)
        self.underruns = 0
        self.resumed = 0  # chunks after a hold: their playback restarts, they cannot be late
        self.text_waits = 0  # the stream's waits for streamed text seen so far (a wait is a hold)

    def chunk_made(self, now: float, frames: int) -> bool:
        """Account a chunk made at `now`; True when it came after the listener needed it. After
        the consumer held the stream back, its playback is taken to resume from here."""
        if self.first_audio is None or self.held:
            self.resumed += self.held
            self.first_audio = now - self.audio_s
            late = False
        else:
            late = now > self.first_audio + self.audio_s
        self.held = False
        self.audio_s += frames / FRAME_RATE
        self.underruns += late
        return late


def _done_stats(stream, live: _Live) -> dict:
    stats = stream.stats
    return {
        "frames": stats.frames, "sentences": stats.sentences, "cancelled": stats.cancelled,
        "hit_token_cap": stats.hit_token_cap, "chunk_frames": stats.chunk_frames,
        "chunk_compute_s": live.compute, "synthesis_s": time.perf_counter() - live.t0,
        "peak_batch": live.peak_batch, "underruns": live.underruns,
        "resumed_chunks": live.resumed,
        "text_mode": stats.text_mode,
        "text_tokens": stats.text_tokens, "text_waits": stats.text_waits,
        # why it ended (protocol.FINISH_REASONS; serving/speech_service.finish_reason reads it)
        "finish_reason": stats.finish_reason, "repetitions": stats.repetitions,
        "loop": stats.loop,
    }  # fmt: skip


def _percentile(values, q: float) -> float | None:
    return round(float(np.percentile(list(values), q)), 5) if values else None


def batching_stats(scheduler, active: int) -> dict:
    """What `/v1/engine/status` and `/metrics` show of the scheduler."""
    sizes = list(scheduler.batch_sizes)
    return {
        "active_streams": active,
        "max_batch": scheduler.max_batch,
        "step_s_p50": _percentile(scheduler.step_s, 50),
        "step_s_p95": _percentile(scheduler.step_s, 95),
        "batch_occupancy": round(sum(sizes) / len(sizes) / scheduler.max_batch, 4)
        if sizes
        else None,
        "kv_bytes": scheduler.kv_bytes(),
        "kv_bytes_per_stream": scheduler.kv_bytes() // max(1, len(scheduler.rows)),
        "steps": len(sizes),
        # streamed text: rows that left the batch to wait for their next token, and came back
        "text_waits": scheduler.text_waits,
        "text_resumes": scheduler.text_resumes,
    }


class _Server:
    """The worker's loop: requests join the scheduler between steps; chunks go out as made."""

    def __init__(self, model, conn: Connection, max_batch: int, step_delay_s: float = 0.0,
                 loop_detector: bool = True) -> None:  # fmt: skip
        self.model = model
        self.conn = conn
        self.step_delay_s = step_delay_s
        self.loop_rules = DEFAULT_LOOP_RULES if loop_detector else None
        self.scheduler = Scheduler(model, max_batch=max_batch, step_delay_s=step_delay_s,
                                   loop_rules=self.loop_rules)  # fmt: skip
        self.live: dict[str, _Live] = {}
        self.stop_requested = False
        self.last_report = 0.0
        self.last_steps = 0.0
        self.underruns = 0  # not yet reported

    def _handle(self, m: msg.ToWorker) -> None:
        if isinstance(m, msg.Synthesize):
            self._admit(m)
        elif isinstance(m, msg.Cancel):
            self.scheduler.cancel(m.id)
        elif isinstance(m, msg.AppendText | msg.EndText):
            self._text(m)
        elif isinstance(m, msg.Taken):
            if (live := self.live.get(m.id)) is not None:
                live.taken = max(live.taken, m.count)
                if live.sent - live.taken < msg.MAX_UNTAKEN:
                    self.scheduler.set_paused(m.id, False)
        elif isinstance(m, msg.Stop):
            self.stop_requested = True
        elif isinstance(m, msg.QueryMemory):
            self.conn.send(msg.MemoryReport(process_memory()))
        elif isinstance(m, msg.StepDelay):  # fault injection, switched while serving
            self.step_delay_s = self.scheduler.step_delay_s = max(0.0, m.seconds)
        # a Cancel or Taken for a request that already finished is dropped

    def _text(self, m: msg.AppendText | msg.EndText) -> None:
        """Streamed text for a running synthesis; its committed token count goes back when it
        grows (the server's `input_text.ack`)."""
        live = self.live.get(m.id)
        if live is None:
            return  # it finished (or failed) meanwhile
        if isinstance(m, msg.AppendText):
            tokens = self.scheduler.append_text(m.id, m.text)
        else:
            tokens = self.scheduler.end_text(m.id)
        if tokens is not None and tokens != live.tokens:
            live.tokens = tokens
            self.conn.send(msg.TextCommitted(m.id, tokens))

    def _admit(self, m: msg.Synthesize) -> None:
        try:
            ref_audio = _load_ref_audio(m.ref_audio) if m.ref_audio else None
            self.scheduler.add(m.id, SpeechRequest(**m.request), ref_audio=ref_audio)
        except Exception as e:  # a failing request must not take the worker down
            self.conn.send(_failure(m.id, e))
            return
        self.live[m.id] = _Live()

    def _send_events(self, events) -> None:
        batch = len(self.scheduler.rows)
        now = time.perf_counter()
        for live in self.live.values():
            live.peak_batch = max(live.peak_batch, batch)
        for ev in events:
            req_id = ev.stream.id
            live = self.live.get(req_id)
            if live is None:
                continue
            if ev.kind == "chunk":
                chunk = ev.chunk
                self.conn.send(msg.Chunk(req_id, pcm16(chunk.audio), chunk.frames, chunk.compute_s))
                live.compute.append(round(chunk.compute_s, 4))
                live.sent += 1
                if ev.stream.stats.text_waits != live.text_waits:  # it waited for streamed text:
                    live.text_waits, live.held = ev.stream.stats.text_waits, True  # not late
                self.underruns += live.chunk_made(now, chunk.frames)
                if live.sent - live.taken >= msg.MAX_UNTAKEN:
                    self.scheduler.set_paused(req_id, True)
                    live.held = True
            elif ev.kind == "done":
                del self.live[req_id]
                self.conn.send(msg.Done(req_id, _done_stats(ev.stream, live)))
            else:
                del self.live[req_id]
                self.conn.send(_failure(req_id, ev.error))

    def _fail_all(self, message: str) -> None:
        for req_id in list(self.live):
            self.conn.send(msg.Failed(req_id, message))
        self.live.clear()

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_report >= REPORT_EVERY_S:
            self.last_report = now
            self.conn.send(msg.BatchingReport(batching_stats(self.scheduler, len(self.live))))
        if self.scheduler.step_log and (force or now - self.last_steps >= STEPS_EVERY_S):
            self.last_steps = now
            self.conn.send(msg.StepTimes(tuple(self.scheduler.step_log), self.underruns))
            self.scheduler.step_log.clear()
            self.underruns = 0

    def run(self) -> None:
        while True:
            # Block for messages while nothing can run; otherwise take what arrived and step.
            while self.conn.poll() or not (self.live and self.scheduler.runnable):
                self._handle(self.conn.recv())
                if self.stop_requested:
                    break
            if self.stop_requested:
                # cut short, and not by the client: an error, not "done"
                self._fail_all("the TTS worker is stopping")
                return
            try:
                events = self.scheduler.step()
            except Exception as e:  # the whole batch failed: end its streams, keep serving
                traceback.print_exc()
                self._fail_all(f"{type(e).__name__}: {e}")
                self.scheduler = Scheduler(self.model, max_batch=self.scheduler.max_batch,
                                           step_delay_s=self.step_delay_s,
                                           loop_rules=self.loop_rules)  # fmt: skip
                continue
            self._send_events(events)
            # A worker about to block (nothing runnable: idle, or every stream waiting for text
            # or paused) reports now; else status would show its last busy second until it woke.
            self._report(force=not (self.live and self.scheduler.runnable))
            if not self.live:
                # Between utterances the process keeps only what the next one needs: the
                # vocoder's activations otherwise stay in mlx's cache and glibc's heap (~130 MB
                # on the real 0.6B), which the footprint and the memory limit both count.
                release_freed_memory()


def _failure(req_id: str, error: BaseException) -> msg.Failed:
    """A stream's error as the server sees it: the client's (a RequestError) or the engine's."""
    if isinstance(error, RequestError):
        return msg.Failed(req_id, error.message, client=True, param=error.param)
    traceback.print_exception(error)
    return msg.Failed(req_id, f"{type(error).__name__}: {error}")


def _wait_for_spec(conn: Connection) -> msg.WorkerSpec | None:
    """A spare's wait: it has imported what loading needs (this module's imports: most of a
    worker's start on a CPU), says so, and waits for the spec of the variant it will load."""
    try:
        conn.send(msg.SpareReady(os.getpid()))
        spec = conn.recv()
    except (EOFError, OSError):
        return None  # closed unused (the engine stopped)
    return spec if isinstance(spec, msg.WorkerSpec) else None


def _load(spec: msg.WorkerSpec):
    """Load and warm up the spec's model; returns (model, info for the server)."""
    source = resolve(spec.model, spec.variant)
    model, details = load(source, progress=spec.progress, compute_dtype=spec.compute_dtype)
    info = {
        "model": spec.model, "variant": source.variant, "source": source.source,
        **details, **describe(model),
        "quantized_modules": quantized_modules(model),
        # What the process memory is made of: weights by part, the KV cache a stream adds
        # per frame, and the process after loading (before warm-up touched the runtime).
        "footprint": {**model_bytes(model), "kv_bytes_per_frame": kv_bytes_per_frame(model),
                      "stream_layout": stream_layout(model).as_dict(),  # admission's memory
                      "loaded": process_memory()},
    }  # fmt: skip
    if spec.warmup:
        t0 = time.perf_counter()
        voice = info["voices"][0] if info["voices"] else None
        warm = SpeechRequest(input=WARMUP_TEXT, voice=voice, max_new_tokens=2, seed=0,
                             instructions="A calm voice.")  # fmt: skip
        for _ in stream_chunks(model, warm):
            pass
        info["warmup_s"] = time.perf_counter() - t0
        release_freed_memory()
    info["memory"] = process_memory()
    return model, info


def worker_main(conn: Connection, spec: msg.WorkerSpec | None) -> None:
    """Entry point of the spawned process. `spec` None: a spare (`dispatch/spare.py`), which
    waits for its spec on `conn` with its modules imported."""
    logging.basicConfig(level=os.environ.get("QWEN3_TTS_LOG_LEVEL", "WARNING"))
    if spec is None and (spec := _wait_for_spec(conn)) is None:
        return
    if spec.nice:
        # A worker loading next to a busy one (make-before-break swap) yields the CPU to it;
        # threads started from here on inherit the main thread's niceness.
        renice(os.getpid(), spec.nice, idle=True)
    try:
        model, info = _load(spec)
        conn.send(msg.Ready(info))
    except Exception as e:
        traceback.print_exc()
        conn.send(msg.LoadFailed(f"{type(e).__name__}: {e}"))
        return
    try:
        _Server(model, conn, spec.max_batch, spec.step_delay_s, spec.loop_detector).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the parent went away
