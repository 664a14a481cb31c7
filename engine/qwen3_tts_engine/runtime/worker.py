"""The handler's worker process: loads one model and runs mlx on this process's main thread.

mlx on a non-main thread fails or aborts at exit (docs/mlx-on-linux.md), so each handler owns
a spawned process. Messages on the pipe (tuples):
  parent -> worker: ("synth", id, request_dict, ref_audio_bytes | None), ("cancel", id),
                    ("taken", id, n_chunks), ("memory",), ("stop",)
  worker -> parent: ("ready", info), ("failed", message), ("chunk", id, pcm_s16le, frames,
                    compute_s), ("done", id, stats), ("error", id, kind, message), ("memory", dict)
Flow control: a chunk counts as taken when the consumer asks for the next one ("taken" carries
the count); the worker starts a chunk only while fewer than MAX_UNTAKEN chunks it sent are
untaken. A consumer that pauses pauses the synthesis, and one that goes away leaves at most the
chunk in progress behind. A stop that arrives while a synthesis waits ends it with an error.
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
from qwen3_tts_engine.protocol import SpeechRequest

WARMUP_TEXT = "Hello, this is a warm-up."
# One: the next chunk is made while the consumer handles this one (the server writes it to the
# socket and asks for more within milliseconds), and nothing piles up when it stops asking.
MAX_UNTAKEN = 1


def _memory() -> dict:
    import mlx.core as mx
    import psutil

    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
    }


def renice(pid: int, value: int) -> bool:
    """Set a process's niceness on every one of its threads (Linux keeps niceness per thread:
    the BLAS threads a preloaded library starts before Python does would keep theirs). Raising
    the priority again needs CAP_SYS_NICE (root in a container); False where it is refused."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]  # no /proc (macOS): niceness is per process there
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, value)
    except (PermissionError, OSError):
        return False
    return True


def _load_ref_audio(data: bytes):
    """Decode reference audio (wav/flac/mp3 bytes) to a 24 kHz mx.array with mlx-audio."""
    from mlx_audio.utils import load_audio

    with tempfile.NamedTemporaryFile(suffix=".audio") as f:
        f.write(data)
        f.flush()
        return load_audio(f.name, sample_rate=24000)


class _Pipe:
    """Receives messages while a synthesis runs: cancels and taken-counts for it, memory
    queries, and a stop held for later."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.stop_requested = False
        self.taken: dict[str, int] = {}

    def _handle(self, msg: tuple, req_id: str) -> bool:
        """Act on one message; True when it cancels `req_id`."""
        if msg[0] == "cancel":
            return msg[1] == req_id
        if msg[0] == "taken":
            self.taken[msg[1]] = max(self.taken.get(msg[1], 0), msg[2])
        elif msg[0] == "stop":
            self.stop_requested = True
        elif msg[0] == "memory":
            self.conn.send(("memory", _memory()))
        return False

    def cancelled(self, req_id: str) -> bool:
        hit = False
        while self.conn.poll():
            hit = self._handle(self.conn.recv(), req_id) or hit
        return hit

    def wait_taken(self, req_id: str, n: int) -> str:
        """Block until the consumer has taken `n` chunks of `req_id`: "taken"; or "cancelled"
        when it cancelled the request instead, "stopping" when the worker is asked to stop."""
        while self.taken.get(req_id, 0) < n:
            if self.stop_requested:
                return "stopping"
            if self._handle(self.conn.recv(), req_id):
                return "cancelled"
        return "taken"


def _synthesize(model, conn: Connection, pipe: _Pipe, req_id: str, body: dict, ref: bytes | None):
    from .synthesis import SynthesisError, SynthesisStats, stream_chunks

    stats = SynthesisStats()
    cancelled = False
    compute: list[float] = []

    def should_stop() -> bool:
        nonlocal cancelled
        cancelled = cancelled or pipe.cancelled(req_id)
        return cancelled

    t0 = time.perf_counter()
    pipe.taken.clear()
    try:
        ref_audio = _load_ref_audio(ref) if ref else None
        for sent, chunk in enumerate(stream_chunks(
            model, SpeechRequest(**body), ref_audio=ref_audio, should_stop=should_stop, stats=stats
        ), start=1):  # fmt: skip
            conn.send(("chunk", req_id, pcm16(chunk.audio), chunk.frames, chunk.compute_s))
            compute.append(round(chunk.compute_s, 4))
            if should_stop():
                stats.cancelled = True
                break
            waited = pipe.wait_taken(req_id, sent + 1 - MAX_UNTAKEN)
            if waited == "stopping":  # cut short, and not by the client: an error, not "done"
                conn.send(("error", req_id, "internal", "the TTS worker is stopping"))
                return
            if waited == "cancelled":
                stats.cancelled = True
                break
    except SynthesisError as e:
        conn.send(("error", req_id, "request", str(e)))
        return
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise
    except Exception as e:  # a failing request must not take the worker down
        traceback.print_exc()
        conn.send(("error", req_id, "internal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("done", req_id, {
        "frames": stats.frames, "sentences": stats.sentences, "cancelled": stats.cancelled,
        "hit_token_cap": stats.hit_token_cap, "chunk_frames": stats.chunk_frames,
        "chunk_compute_s": compute,
        "synthesis_s": time.perf_counter() - t0,
    }))  # fmt: skip


def worker_main(conn: Connection, spec: dict) -> None:
    """Entry point of the spawned process."""
    logging.basicConfig(level=os.environ.get("QWEN3_TTS_LOG_LEVEL", "WARNING"))
    if spec.get("nice"):
        # A worker loading next to a busy one (make-before-break swap) yields the CPU to it;
        # threads started from here on inherit the main thread's niceness.
        renice(os.getpid(), spec["nice"])
    try:
        from qwen3_tts_engine.models.footprint import kv_bytes_per_frame, model_bytes
        from qwen3_tts_engine.models.loading import load, quantized_modules, release_freed_memory
        from qwen3_tts_engine.models.variants import resolve

        from .synthesis import model_info, stream_chunks

        source = resolve(spec["model"], spec.get("variant"))
        model, details = load(source, progress=spec.get("progress", False))
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

    pipe = _Pipe(conn)
    while not pipe.stop_requested:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the parent went away
        if msg[0] == "stop":
            break
        try:
            if msg[0] == "synth":
                _synthesize(model, conn, pipe, msg[1], msg[2], msg[3])
                # Between utterances the process keeps only what the next one needs: the
                # vocoder's activations otherwise stay in mlx's cache and glibc's heap (~130 MB
                # on the real 0.6B), which the footprint and the memory limit both count.
                release_freed_memory()
            elif msg[0] == "memory":
                conn.send(("memory", _memory()))
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return  # the parent went away mid-request
        # a "cancel" for a request that already finished is dropped
