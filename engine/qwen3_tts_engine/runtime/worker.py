"""The handler's worker process: loads one model and runs mlx on this process's main thread.

mlx on a non-main thread fails or aborts at exit (docs/mlx-on-linux.md), so each handler owns
a spawned process. Its requests run together on one model (`scheduler.py`): a request that
arrives joins the batch at the next step. Messages on the pipe (tuples):
  parent -> worker: ("synth", id, request_dict, ref_audio_bytes | None), ("cancel", id),
                    ("taken", id, n_chunks), ("memory",), ("stop",)
  worker -> parent: ("ready", info), ("failed", message), ("chunk", id, pcm_s16le, frames,
                    compute_s), ("done", id, stats), ("error", id, kind, message), ("memory", dict),
                    ("batching", stats)
Flow control, per request: a chunk counts as taken when the consumer asks for the next one
("taken" carries the count); a stream is paused (out of the batch) while MAX_UNTAKEN chunks it
sent are untaken. A consumer that pauses pauses its stream only, and one that goes away leaves
at most one chunk behind. A stop ends the streams still running with an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import traceback
from multiprocessing.connection import Connection

from qwen3_tts_engine.audio import pcm16
from qwen3_tts_engine.protocol import DEFAULT_MAX_BATCH, SpeechRequest

WARMUP_TEXT = "Hello, this is a warm-up."
# Two: a stream makes its next chunk while the consumer handles this one, and at most one chunk
# waits when the consumer stops asking. (With one, every stream would sit out a step after each
# chunk until its "taken" came back, and leave and rejoin the batch each time.)
MAX_UNTAKEN = 2
REPORT_EVERY_S = 1.0  # how often a busy worker sends its batching stats


def _memory() -> dict:
    import mlx.core as mx
    import psutil

    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
    }


def renice(pid: int, value: int, *, idle: bool = False) -> bool:
    """Set a process's niceness on every one of its threads (Linux keeps niceness per thread:
    the BLAS threads a preloaded library starts before Python does would keep theirs). `idle`:
    also Linux's SCHED_IDLE policy (the threads run only on a CPU nothing else wants, and a waking
    normal thread preempts them at once), or back to SCHED_OTHER; only where this process may
    raise priorities again (`can_raise_priority`), so that a worker is never left idle-scheduled.
    Raising the priority needs CAP_SYS_NICE (root in a container); False where it is refused."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]  # no /proc (macOS): niceness is per process there
    policy = None
    if hasattr(os, "SCHED_IDLE") and can_raise_priority():
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                if policy is not None:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, value)
    except (PermissionError, OSError):
        return False
    return True


def can_raise_priority() -> bool:
    """Whether this process may lower a niceness again (root, or an RLIMIT_NICE that allows 0)."""
    if os.geteuid() == 0:
        return True
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except (ImportError, AttributeError, OSError, ValueError):
        return False


def _load_ref_audio(data: bytes):
    """Decode reference audio (wav/flac/mp3 bytes) to a 24 kHz mx.array with mlx-audio."""
    from mlx_audio.utils import load_audio

    with tempfile.NamedTemporaryFile(suffix=".audio") as f:
        f.write(data)
        f.flush()
        return load_audio(f.name, sample_rate=24000)


class _Live:
    """Parent-side bookkeeping of one stream in the worker: chunks sent and taken, timing."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.sent = 0
        self.taken = 0
        self.compute: list[float] = []
        self.peak_batch = 0


def _done_stats(stream, live: _Live) -> dict:
    stats = stream.stats
    return {
        "frames": stats.frames, "sentences": stats.sentences, "cancelled": stats.cancelled,
        "hit_token_cap": stats.hit_token_cap, "chunk_frames": stats.chunk_frames,
        "chunk_compute_s": live.compute, "synthesis_s": time.perf_counter() - live.t0,
        "peak_batch": live.peak_batch,
    }  # fmt: skip


def _percentile(values, q: float) -> float | None:
    import numpy as np

    return round(float(np.percentile(list(values), q)), 5) if values else None


def batching_stats(scheduler, active: int) -> dict:
    """What `/v1/engine/status` and `/metrics` show of the scheduler."""
    sizes = list(scheduler.batch_sizes)
    return {
        "active_streams": active,
        "max_batch": scheduler.max_batch,
        "step_s_p50": _percentile(scheduler.step_s, 50),
        "step_s_p95": _percentile(scheduler.step_s, 95),
        "batch_occupancy": round(sum(sizes) / len(sizes) / scheduler.max_batch, 4) if sizes else None,
        "kv_bytes": scheduler.kv_bytes(),
        "kv_bytes_per_stream": scheduler.kv_bytes() // max(1, len(scheduler.rows)),
        "steps": len(sizes),
    }


class _Server:
    """The worker's loop: requests join the scheduler between steps; chunks go out as made."""

    def __init__(self, model, conn: Connection, max_batch: int) -> None:
        from .scheduler import Scheduler

        self.model = model
        self.conn = conn
        self.scheduler = Scheduler(model, max_batch=max_batch)
        self.live: dict[str, _Live] = {}
        self.stop_requested = False
        self.last_report = 0.0

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "synth":
            self._admit(*msg[1:])
        elif kind == "cancel":
            self.scheduler.cancel(msg[1])
        elif kind == "taken":
            if (live := self.live.get(msg[1])) is not None:
                live.taken = max(live.taken, msg[2])
                if live.sent - live.taken < MAX_UNTAKEN:
                    self.scheduler.set_paused(msg[1], False)
        elif kind == "stop":
            self.stop_requested = True
        elif kind == "memory":
            self.conn.send(("memory", _memory()))
        # a "cancel" or "taken" for a request that already finished is dropped

    def _admit(self, req_id: str, body: dict, ref: bytes | None) -> None:
        from .synthesis import SynthesisError

        try:
            ref_audio = _load_ref_audio(ref) if ref else None
            self.scheduler.add(req_id, SpeechRequest(**body), ref_audio=ref_audio)
        except SynthesisError as e:
            self.conn.send(("error", req_id, "request", str(e)))
            return
        except Exception as e:  # a failing request must not take the worker down
            traceback.print_exc()
            self.conn.send(("error", req_id, "internal", f"{type(e).__name__}: {e}"))
            return
        self.live[req_id] = _Live()

    def _send_events(self, events) -> None:
        batch = len(self.scheduler.rows)
        for live in self.live.values():
            live.peak_batch = max(live.peak_batch, batch)
        for ev in events:
            req_id = ev.stream.id
            live = self.live.get(req_id)
            if live is None:
                continue
            if ev.kind == "chunk":
                chunk = ev.chunk
                self.conn.send(("chunk", req_id, pcm16(chunk.audio), chunk.frames, chunk.compute_s))
                live.compute.append(round(chunk.compute_s, 4))
                live.sent += 1
                if live.sent - live.taken >= MAX_UNTAKEN:
                    self.scheduler.set_paused(req_id, True)
            elif ev.kind == "done":
                del self.live[req_id]
                self.conn.send(("done", req_id, _done_stats(ev.stream, live)))
            else:
                del self.live[req_id]
                from .synthesis import SynthesisError

                error = ev.error
                if not isinstance(error, SynthesisError):
                    traceback.print_exception(error)
                kind = "request" if isinstance(error, SynthesisError) else "internal"
                self.conn.send(("error", req_id, kind, str(error) if kind == "request"
                                else f"{type(error).__name__}: {error}"))  # fmt: skip

    def _fail_all(self, message: str) -> None:
        for req_id in list(self.live):
            self.conn.send(("error", req_id, "internal", message))
        self.live.clear()

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_report >= REPORT_EVERY_S:
            self.last_report = now
            self.conn.send(("batching", batching_stats(self.scheduler, len(self.live))))

    def run(self) -> None:
        from .scheduler import Scheduler

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
                self.scheduler = Scheduler(self.model, max_batch=self.scheduler.max_batch)
                continue
            self._send_events(events)
            self._report()
            if not self.live:
                self._report(force=True)
                # Between utterances the process keeps only what the next one needs: the
                # vocoder's activations otherwise stay in mlx's cache and glibc's heap (~130 MB
                # on the real 0.6B), which the footprint and the memory limit both count.
                from qwen3_tts_engine.models.loading import release_freed_memory

                release_freed_memory()


def _preload() -> None:
    """A spare worker's head start: the modules that loading a model imports (most of a worker's
    start on a CPU), without a model."""
    from qwen3_tts_engine.models.loading import defer_unused_imports

    defer_unused_imports()
    import mlx_audio.tts.models.qwen3_tts  # noqa: F401
    import transformers  # noqa: F401  (mlx-audio loads the text tokenizer with it)

    from qwen3_tts_engine.models import footprint, loading, variants  # noqa: F401

    from . import synthesis  # noqa: F401


def worker_main(conn: Connection, spec: dict | None) -> None:
    """Entry point of the spawned process. `spec` None: a spare (handler.SpareWorker), which
    imports what loading needs and then waits for its spec on `conn`."""
    logging.basicConfig(level=os.environ.get("QWEN3_TTS_LOG_LEVEL", "WARNING"))
    if spec is None:
        try:
            _preload()
            conn.send(("spare", os.getpid()))  # ready: SpareWorker.wait_ready
            spec = conn.recv()
        except (EOFError, OSError):
            return  # closed unused (the engine stopped)
        if not isinstance(spec, dict):
            return
    if spec.get("nice"):
        # A worker loading next to a busy one (make-before-break swap) yields the CPU to it;
        # threads started from here on inherit the main thread's niceness.
        renice(os.getpid(), spec["nice"], idle=True)
    try:
        from qwen3_tts_engine.models.footprint import kv_bytes_per_frame, model_bytes
        from qwen3_tts_engine.models.loading import load, quantized_modules, release_freed_memory
        from qwen3_tts_engine.models.variants import resolve

        from .synthesis import model_info, stream_chunks

        source = resolve(spec["model"], spec.get("variant"))
        model, details = load(source, progress=spec.get("progress", False),
                              compute_dtype=spec.get("compute_dtype"))  # fmt: skip
        info = {
            "model": spec["model"], "variant": source.variant, "source": source.source,
            **details, **model_info(model),
            "quantized_modules": quantized_modules(model),
            # What the process memory is made of: weights by part, the KV cache a stream adds
            # per frame, and the process after loading (before warm-up touched the runtime).
            "footprint": {**model_bytes(model), "kv_bytes_per_frame": kv_bytes_per_frame(model),
                          "loaded": _memory()},
        }  # fmt: skip
        if spec.get("warmup", True):
            t0 = time.perf_counter()
            voice = info["voices"][0] if info["voices"] else None
            warm = SpeechRequest(input=WARMUP_TEXT, voice=voice, max_new_tokens=2, seed=0,
                                 instructions="A calm voice.")  # fmt: skip
            for _ in stream_chunks(model, warm):
                pass
            info["warmup_s"] = time.perf_counter() - t0
            release_freed_memory()
        info["memory"] = _memory()
        conn.send(("ready", info))
    except Exception as e:
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return

    try:
        _Server(model, conn, spec.get("max_batch", DEFAULT_MAX_BATCH)).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the parent went away
