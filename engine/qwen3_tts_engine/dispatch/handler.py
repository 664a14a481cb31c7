"""A handler: one loaded model in one precision, in its own worker process, as an async unit.

The server's side of a worker process (`worker/main.py` is the other side; `messages.py` the
pipe between them). It is started (load + warm-up), serves up to `max_batch` syntheses at once
(its worker batches them: `worker/scheduler.py`), or fewer: only as many as its worker's
measured steps keep in real time (`capacity.py`) and whose memory fits its memory budget
(`memory_budget`, counted by `models/stream_memory.py`), with a bounded FIFO queue for the rest
whose wait is measured; it can be drained and stopped, and restarts its worker when that dies. The governor swaps
handlers; the server routes requests to them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import psutil

from qwen3_tts_engine import messages as msg
from qwen3_tts_engine.dispatch.capacity import (
    PROBE_EVERY_S,
    Admission,
    StepModel,
    default_frame_budget,
)
from qwen3_tts_engine.dispatch.launch import spawn_worker
from qwen3_tts_engine.dispatch.spare import SpareWorker
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.memory_plan import chunk_transient_bytes
from qwen3_tts_engine.models.stream_memory import StreamLayout, frame_budget
from qwen3_tts_engine.priority import renice
from qwen3_tts_engine.protocol import (
    DEFAULT_MAX_BATCH,
    RequestError,
    SpeechRequest,
    check_compute_dtype,
)
from qwen3_tts_engine.rules import ModelInfo, text_mode_for

_ids = itertools.count(1)


class HandlerError(RuntimeError):
    """Synthesis failed for a reason that is not the client's (worker died, load failed)."""


class HandlerDraining(HandlerError):
    """The handler stopped taking work before this request started: route it to another one."""


class QueueFull(RuntimeError):
    """The handler cannot take the request in time: its batch and its queue are full (429)."""


@dataclass
class AudioChunk:
    pcm: bytes  # s16le, 24 kHz mono
    frames: int
    compute_s: float
    index: int


@dataclass
class Result:
    """Filled in while a synthesis runs; complete once its stream ends."""

    queue_wait_s: float = 0.0
    first_audio_s: float | None = None
    stats: dict | None = None
    variant: str | None = None


class Handler:
    def __init__(
        self,
        model: str,
        variant: str | None = None,
        *,
        warmup: bool = True,
        max_queue: int = 32,
        restart: bool = True,
        load_timeout: float = 1800.0,
        max_batch: int = DEFAULT_MAX_BATCH,
        compute_dtype: str | None = None,
        frame_budget_s: float | None | str = "default",
        step_delay_s: float = 0.0,
        loop_detector: bool = True,
        probe_every_s: float | None = PROBE_EVERY_S,
        stream_memory_bytes: int | None = None,
        worker_memory_bytes: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        check_compute_dtype(compute_dtype)
        self.model = model
        self.requested_variant = variant
        self.warmup = warmup
        self.max_queue = max_queue
        self.restart = restart
        self.load_timeout = load_timeout
        self.max_batch = max_batch
        self.compute_dtype = compute_dtype  # as asked (None: its weights' dtype; "auto")
        # the longest a batch step may take (None: no budget, slots = max_batch); by default
        # QWEN3_TTS_FRAME_BUDGET_MS or 80 ms
        self.frame_budget_s = (
            default_frame_budget() if frame_budget_s == "default" else frame_budget_s
        )
        self.step_delay_s = step_delay_s  # fault injection (messages.WorkerSpec; set_step_delay)
        self.loop_detector = (
            loop_detector  # the worker ends looping sentences (messages.WorkerSpec)
        )
        self.probe_every_s = probe_every_s  # while requests wait, one over the slots this often
        # The memory rule (`memory_budget`): the bytes its streams may hold, or the bytes the
        # whole worker may (its streams get what its RSS when ready leaves); None: no rule.
        self.stream_memory_bytes = stream_memory_bytes
        self.worker_memory_bytes = worker_memory_bytes
        self._ready_rss: int | None = None
        self.steps = StepModel()
        self.underruns = 0  # chunks made after their listener needed them (all workers so far)
        self.step_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self.name = f"{model}:{variant or 'default'}#{next(_ids)}"
        self.nice = 0  # the worker's niceness while it starts (set_nice changes it later)
        self.state = "stopped"  # starting | ready | draining | failed | stopped
        self.info: dict = {}
        self.restarts = 0
        self.last_stats: dict | None = None  # the worker's stats of the last finished synthesis
        self.history: collections.deque[dict] = collections.deque(maxlen=256)  # recent stats
        self.batching: dict = {}  # the worker's scheduler stats (active streams, step times...)
        self.memory_reports = 0  # memory answers received from the worker
        self.waiting = 0
        self.in_flight = 0
        # FIFO beyond the streams in real time; a step report may admit one over (a probe)
        self._slots = Admission(lambda: self.slots, most=max_batch, probe_every_s=probe_every_s,
                                fits=self._memory_fits)  # fmt: skip
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = asyncio.Event()
        self._draining = asyncio.Event()  # set by drain()/stop(): queued requests leave
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self._control: asyncio.Queue = asyncio.Queue()  # the worker's start-up answer
        self._streams: dict[str, asyncio.Queue] = {}  # each running request's messages
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_task: asyncio.Task | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    def sibling(self, variant: str | None) -> Handler:
        """A new, unstarted handler of the same model and options in `variant` (for swaps). Its
        step times start from this one's (a prior its own steps replace as they come), so a swap
        under load does not drop the engine to one slot until the new worker has measured."""
        new = Handler(self.model, variant, warmup=self.warmup, max_queue=self.max_queue,
                       restart=self.restart, load_timeout=self.load_timeout,
                       max_batch=self.max_batch, compute_dtype=self.compute_dtype,
                       frame_budget_s=self.frame_budget_s, step_delay_s=self.step_delay_s,
                       loop_detector=self.loop_detector, probe_every_s=self.probe_every_s,
                       stream_memory_bytes=self.stream_memory_bytes,
                       worker_memory_bytes=self.worker_memory_bytes)  # fmt: skip
        new.steps = self.steps.copy()
        return new

    @property
    def variant(self) -> str | None:
        return self.info.get("variant", self.requested_variant)

    @property
    def loaded_compute_dtype(self) -> str | None:
        """The dtype the worker's talker computes in ("auto" as the worker resolved it)."""
        return self.info["compute_dtype"] if "compute_dtype" in self.info else self.compute_dtype

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def queue_depth(self) -> int:
        return self.waiting + self.in_flight

    @property
    def slots(self) -> int:
        """Streams this handler keeps in real time now (1..max_batch): its measured step time
        against the frame budget (`capacity.py`); max_batch without a budget."""
        return self.steps.slots(self.frame_budget_s, self.max_batch)

    @property
    def stream_layout(self) -> StreamLayout | None:
        """What one stream of this worker's model holds (its worker says, from the model's config
        and dtypes; the vocoder's chunk transient from the plan's measurement); None before load."""
        layout = self.info.get("footprint", {}).get("stream_layout")
        if not layout:
            return None
        return replace(StreamLayout.from_dict(layout),
                       chunk_transient=chunk_transient_bytes(self.variant))  # fmt: skip

    @property
    def memory_budget(self) -> int | None:
        """Bytes the streams of this worker may hold together (None: no memory rule): as set, or
        the worker's budget less its RSS when it became ready (loaded and warmed)."""
        if self.stream_memory_bytes is not None:
            return self.stream_memory_bytes
        if self.worker_memory_bytes is None or self._ready_rss is None:
            return None
        return max(0, self.worker_memory_bytes - self._ready_rss)

    @property
    def stream_memory(self) -> int:
        """Bytes the running streams hold at their largest (`StreamLayout.batch_bytes`)."""
        layout = self.stream_layout
        return layout.batch_bytes(self._slots.held) if layout is not None else 0

    @property
    def waiting_for_memory(self) -> bool:
        """The first queued request has a slot but not the memory (it starts when one ends)."""
        return self._slots.held_by_memory

    def _memory_fits(self, budgets: list[int]) -> bool:
        budget, layout = self.memory_budget, self.stream_layout
        return budget is None or layout is None or layout.batch_bytes(budgets) <= budget

    def frame_budget(self, req: SpeechRequest) -> int:
        """The most frames one cache row of `req` holds here (its admission cost)."""
        try:
            mode = text_mode_for(req, ModelInfo.from_info(self.info))
        except (KeyError, RequestError):  # not loaded yet, or a request the worker will refuse
            mode = "dual" if req.text_stream else "prompt"
        return frame_budget(req, mode)

    @property
    def probes(self) -> int:
        """Requests admitted one over the slots to measure the next size (`capacity.Admission`)."""
        return self._slots.probes

    def set_step_delay(self, seconds: float) -> None:
        """Fault injection while serving: every batch step of the worker sleeps `seconds` per
        stream in it from its next step on (0: off); kept for a restarted worker and a swap's."""
        self.step_delay_s = seconds
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            self._send(msg.StepDelay(seconds))

    def take_step_samples(self) -> list[tuple[int, float]]:
        """The (streams, seconds) steps reported since the last call (for a histogram)."""
        samples = list(self.step_samples)
        self.step_samples.clear()
        return samples

    async def start(self, spare: SpareWorker | None = None) -> dict:
        """Spawn the worker (or hand `spare` the spec), load and warm the model; returns the
        worker's info."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._draining.clear()
        self.state = "starting"
        self._ready.clear()
        spec = msg.WorkerSpec(model=self.model, variant=self.requested_variant,
                              warmup=self.warmup, nice=self.nice, max_batch=self.max_batch,
                              compute_dtype=self.compute_dtype, step_delay_s=self.step_delay_s,
                              loop_detector=self.loop_detector)  # fmt: skip
        # from before the spawn: a forked worker starts loading before spawn_worker returns here
        # (its load_s, on its own clock, could otherwise exceed start_s on a busy machine)
        t0 = time.perf_counter()
        if spare is not None and spare.take(self.nice):
            self._proc, parent = spare.proc, spare.conn
            parent.send(spec)
        else:
            if spare is not None:
                await asyncio.to_thread(spare.close)
            self._proc, parent = spawn_worker(spec, f"qwen3-tts-worker {self.name}")
            if self.nice:  # from its interpreter's start-up on, not only once worker_main runs:
                renice(
                    self._proc.pid, self.nice, idle=True
                )  # start-up and imports: most of a load's CPU
        self._conn = parent
        self._control = asyncio.Queue()
        threading.Thread(target=self._read, args=(parent, self._proc), daemon=True).start()
        try:
            answer = await asyncio.wait_for(self._control.get(), self.load_timeout)
        except TimeoutError:
            self._kill()
            self.state = "failed"
            raise HandlerError(
                f"{self.name}: loading took longer than {self.load_timeout}s"
            ) from None
        if not isinstance(answer, msg.Ready):
            self._kill()
            self.state = "failed"
            detail = (answer.message if isinstance(answer, msg.LoadFailed)
                      else f"worker exited ({answer.exitcode})")  # fmt: skip
            raise HandlerError(f"{self.name}: could not load {self.model!r}: {detail}")
        self.info = {**answer.info, "start_s": time.perf_counter() - t0, "pid": self._proc.pid}
        self._ready_rss = answer.info.get("memory", {}).get("rss_bytes")
        self.state = "ready"
        self._ready.set()
        logger.info("handler %s ready (variant %s, pid %s, %.1fs)", self.name, self.variant,
                    self._proc.pid, self.info["start_s"])  # fmt: skip
        return self.info

    def _read(self, conn, proc) -> None:
        """Reader thread: forwards worker messages to the event loop; EOF means the worker died."""
        loop = self._loop
        while True:
            try:
                m = conn.recv()
            except (
                Exception
            ) as e:  # EOF: it exited; anything else: a message cut short (killed mid-send)
                if not isinstance(e, EOFError | OSError):
                    logger.warning(
                        "handler %s: unreadable message from its worker: %r", self.name, e
                    )
                proc.join(timeout=5)
                loop.call_soon_threadsafe(self._route, msg.Died(proc.exitcode), proc)
                return
            loop.call_soon_threadsafe(self._route, m, proc)

    def _route(self, m: msg.FromWorker | msg.Died, proc) -> None:
        """On the event loop: a worker message to the request it is about, or to the handler."""
        if proc is not self._proc:
            return  # a previous worker's last words (it was replaced)
        if isinstance(m, msg.Ready | msg.LoadFailed):
            self._control.put_nowait(m)
        elif isinstance(m, msg.Died):
            for queue in self._streams.values():
                queue.put_nowait(m)
            if self.state == "starting":
                self._control.put_nowait(m)
            elif not self._stopping:
                self._on_death(m.exitcode)
        elif isinstance(m, msg.MemoryReport):
            self.info["memory"] = m.memory
            self.memory_reports += 1
        elif isinstance(m, msg.BatchingReport):
            self.batching = m.stats
        elif isinstance(m, msg.StepTimes):
            for streams, seconds in m.steps:
                self.steps.observe(streams, seconds)
            self.step_samples.extend(m.steps)
            self.underruns += m.underruns
            self._slots.wake(probe=True)  # the slots may have grown; or try one more
        elif isinstance(m, msg.Chunk | msg.TextCommitted | msg.Done | msg.Failed):
            if (queue := self._streams.get(m.id)) is not None:
                queue.put_nowait(m)
        # a message of a request that is gone (cancelled and acknowledged) is dropped

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)

    async def drain(self, timeout: float | None = None) -> None:
        """Stop taking new work; wait for the in-flight synthesis to finish. Queued requests
        that have not started leave with HandlerDraining (the engine routes them elsewhere)."""
        if self.state == "ready":
            self.state = "draining"
        self._draining.set()
        t_end = None if timeout is None else time.monotonic() + timeout
        while self.queue_depth:
            remaining = None if t_end is None else max(0.0, t_end - time.monotonic())
            try:
                await asyncio.wait_for(self._idle.wait(), remaining)
            except TimeoutError:
                logger.warning("handler %s: drain deadline passed with %d requests in flight",
                               self.name, self.queue_depth)  # fmt: skip
                return

    async def stop(self, *, drain: bool = True, timeout: float | None = None,
                   grace: float = 10.0) -> None:  # fmt: skip
        """Drain (optionally), then end the worker process so its memory returns to the system;
        a worker still busy after `grace` seconds is killed."""
        if drain:
            await self.drain(timeout)
        self._stopping = True
        self._draining.set()
        if self._restart_task:
            self._restart_task.cancel()
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(msg.Stop())
            except OSError:
                pass
            await asyncio.to_thread(self._proc.join, grace)
        self._kill()
        self.state = "stopped"
        self._ready.clear()

    def set_nice(self, value: int) -> bool:
        """The worker's CPU priority now (all its threads); False if the OS refused."""
        if self._proc is None or not self._proc.is_alive():
            return False
        ok = renice(self._proc.pid, value, idle=value > 0)
        if ok:
            self.nice = value
        else:
            logger.warning(
                "handler %s: cannot set niceness %d (needs CAP_SYS_NICE)", self.name, value
            )
        return ok

    async def memory(self) -> dict:
        """Worker memory: RSS from the OS plus mlx's own counters from the last report."""
        out = dict(self.info.get("memory", {}))
        if self._proc is not None and self._proc.is_alive():
            try:
                out["rss_bytes"] = psutil.Process(self._proc.pid).memory_info().rss
            except psutil.Error:
                pass
        return out

    def _on_death(self, exitcode) -> None:
        self.state = "failed"
        self._ready.clear()
        logger.error("handler %s: worker died (exit code %s)", self.name, exitcode)
        if self.restart and not self._stopping:
            self._restart_task = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        self.restarts += 1
        try:
            await self.start()
        except HandlerError as e:
            logger.error("handler %s: restart failed: %s", self.name, e)

    # -- synthesis ---------------------------------------------------------------------------

    async def synthesize(
        self,
        req: SpeechRequest,
        *,
        ref_audio: bytes | None = None,
        result: Result | None = None,
        text: TextInput | None = None,
    ) -> AsyncIterator[AudioChunk]:
        """Stream audio chunks for `req`. Closing the iterator early cancels the synthesis.
        `text`: the text of a streamed-text request, sent to the worker as it arrives."""
        if self.state in ("draining", "stopped"):
            raise HandlerDraining(f"handler {self.name} is {self.state}")
        if self.waiting >= self.max_queue:
            raise QueueFull(f"{self.waiting} requests are already waiting")
        result = result if result is not None else Result()
        t0 = time.perf_counter()
        cost = self.frame_budget(req)
        self.waiting += 1
        self._idle.clear()
        try:
            try:
                await self._take_turn(cost)
            finally:
                self.waiting -= 1
            self.in_flight += 1
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns when the event is
                # already set even if this task was cancelled meanwhile (a client that went away
                # as its slot came), and the stream then started for nobody and never ended
                async with asyncio.timeout(self.load_timeout):
                    await self._ready.wait()
                result.queue_wait_s = time.perf_counter() - t0
                result.variant = self.variant
                # aclosing: an abandoned stream cancels the worker's synthesis and waits for its
                # acknowledgement before its slot passes on (not later, when it is collected).
                async with contextlib.aclosing(
                    self._run(req, ref_audio, result, t0, text)
                ) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:
                self.in_flight -= 1
                self._slots.release(cost)
        finally:
            if self.queue_depth == 0:
                self._idle.set()

    async def _take_turn(self, cost: int) -> None:
        """Wait for a free slot and the memory of a stream of `cost` frames (FIFO); leave the
        queue with HandlerDraining as soon as the handler drains, so a swap's new handler serves
        queued requests without waiting for this one."""
        acquire = asyncio.ensure_future(self._slots.acquire(cost))
        leave = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({acquire, leave}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled while queued (client went away)
            leave.cancel()
            if not acquire.cancel() and not acquire.cancelled() and acquire.exception() is None:
                self._slots.release(cost)  # it was granted in the meantime
            raise
        leave.cancel()
        if acquire.cancel():  # still queued: a cancelled acquire never takes the lock
            raise HandlerDraining(f"handler {self.name} is {self.state}")
        if self.state in ("draining", "stopped"):
            self._slots.release(cost)
            raise HandlerDraining(f"handler {self.name} is {self.state}")

    async def _run(self, req, ref_audio, result: Result, t0: float,
                   text: TextInput | None = None) -> AsyncIterator[AudioChunk]:  # fmt: skip
        req_id = f"r{next(_ids)}"
        inbox: asyncio.Queue = asyncio.Queue()
        self._streams[req_id] = inbox
        finished = False
        index = 0
        try:
            if self.state == "failed" or self._proc is None or not self._proc.is_alive():
                finished = True
                raise HandlerError(f"{self.name}: its worker is not running")
            self._conn.send(msg.Synthesize(req_id, req.to_dict(), ref_audio))
            if text is not None:
                text.attach(lambda piece: self._send(msg.AppendText(req_id, piece)),
                            lambda: self._send(msg.EndText(req_id)))  # fmt: skip
            while True:
                m = await inbox.get()
                if isinstance(m, msg.Died):
                    finished = True
                    raise HandlerError(
                        f"the TTS worker died during synthesis (exit code {m.exitcode})"
                        + ("" if self._stopping else "; it is being restarted")
                    )
                if isinstance(m, msg.TextCommitted):
                    if text is not None:
                        text.tokens = m.tokens
                elif isinstance(m, msg.Chunk):
                    if result.first_audio_s is None:
                        result.first_audio_s = time.perf_counter() - t0
                    yield AudioChunk(m.pcm, m.frames, m.compute_s, index)
                    index += 1
                    try:  # the consumer wants the next one: the worker may go on (flow control)
                        self._conn.send(msg.Taken(req_id, index))
                    except OSError:
                        pass  # the worker died; its Died message is next
                elif isinstance(m, msg.Done):
                    finished = True
                    result.stats = self.last_stats = m.stats
                    self.history.append(m.stats)
                    return
                elif isinstance(m, msg.Failed):
                    finished = True
                    if m.client:
                        raise RequestError(m.message, param=m.param)
                    raise HandlerError(m.message)
        finally:
            if text is not None:
                text.detach()
            try:
                if not finished:
                    # The consumer went away (client disconnect, barge-in): stop the stream
                    # within one frame and wait for the worker's acknowledgement.
                    await _uninterrupted(self._cancel(req_id, inbox))
            finally:
                self._streams.pop(req_id, None)

    def _send(self, m: msg.ToWorker) -> None:
        try:
            self._conn.send(m)
        except OSError:
            pass  # the worker died; its Died message reaches the stream

    async def _cancel(self, req_id: str, inbox: asyncio.Queue) -> None:
        try:
            self._conn.send(msg.Cancel(req_id))
        except OSError:
            return
        while True:
            try:
                m = await asyncio.wait_for(inbox.get(), 60)
            except TimeoutError:
                logger.error(
                    "handler %s: no acknowledgement of a cancel; killing the worker", self.name
                )
                self._kill()
                return
            if isinstance(m, msg.Died):
                return
            if isinstance(m, msg.Done | msg.Failed):
                self.last_stats = m.stats if isinstance(m, msg.Done) else None
                if self.last_stats:
                    self.history.append(self.last_stats)
                return


async def _uninterrupted(coro) -> None:
    """Run `coro` to its end even if the caller is cancelled meanwhile (once or more often);
    then re-raise the cancellation. The FIFO lock must not pass on before a cancel is
    acknowledged, or the next request would read this one's last messages."""
    task = asyncio.ensure_future(coro)
    interrupted = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            interrupted = True
    task.result()
    if interrupted:
        raise asyncio.CancelledError
