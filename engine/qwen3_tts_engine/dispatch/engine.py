"""The engine core: the handlers of one voice model by variant, request routing, and the
hold / route_to / forget / resume steps a variant swap goes through."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from qwen3_tts_engine.dispatch.handler import (
    AudioChunk,
    Handler,
    HandlerDraining,
    HandlerError,
    Result,
)
from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.log import logger
from qwen3_tts_engine.models.recipes import RECIPES
from qwen3_tts_engine.protocol import ENGINE_FULL, LoadReport, RequestError, SpeechRequest
from qwen3_tts_engine.rules import ModelInfo, check_request


@dataclass(frozen=True)
class MemoryBand:
    """The memory governor's reading (the used fraction of its limit) and its policy's band."""

    pressure: float
    upgrade_at: float  # at or below: memory is comfortable
    critical_at: float  # at or above: no headroom (the governor steps down at once)

    def load(self) -> float:
        """0 at or below `upgrade_at`, 1 at `critical_at`, linear between (capped to 0..1)."""
        span = max(1e-6, self.critical_at - self.upgrade_at)
        return min(1.0, max(0.0, (self.pressure - self.upgrade_at) / span))


def free_slots(state: str, slots: int, streams: int, memory_load: float) -> int:
    """The engine's one definition of free (docs/fleet.md; the plugin's `fleet.free_slots` is
    the client's, tests/plugins/qwen3_tts/test_wire_contract.py keeps them equal): the slots
    neither running nor promised to a waiting request (`streams`: running + waiting), and none
    unless the engine serves (not loading, swapping or draining) with memory below the
    governor's critical mark. Full: 0."""
    if state != "serving" or memory_load >= 1.0:
        return 0
    return max(0, slots - streams)


class Engine:
    """The handlers of one voice model, by variant; `active` serves requests that name none.

    Swaps (the governor's) go through `hold`, `route_to` and `forget`: during a break-before-make
    swap no handler takes new work and requests wait in `acquire()` until the next one serves;
    a handler replaced by a make-before-break swap finishes its utterances in `retiring`.
    """

    def __init__(
        self, model: str, handlers: list[Handler], *, wait_timeout: float = 1800.0
    ) -> None:
        if not handlers:
            raise ValueError("an engine needs at least one handler")
        self.model = model
        self.handlers: dict[str, Handler] = {}
        self._order = handlers
        self.active: Handler = handlers[0]
        self.retiring: list[Handler] = []
        self.info: dict = {}  # model info (voices, languages): the same for every variant
        self.pending_variant: str | None = None  # what a break-before-make swap is loading
        self.wait_timeout = wait_timeout
        self.gap_waiting = 0
        self.retired_underruns = 0  # of handlers that left (the counter never goes down)
        self._serving = asyncio.Event()

    async def start(self) -> None:
        for h in self._order:
            await h.start()
            self.handlers[h.variant] = h
        self.active = self._order[0]
        self.info = self.active.info
        self._serving.set()

    async def stop(self) -> None:
        for h in [*self.handlers.values(), *self.retiring]:
            await h.stop(drain=False)

    @property
    def serving(self) -> bool:
        """False while a break-before-make swap is between handlers."""
        return self._serving.is_set()

    def all_handlers(self) -> list[Handler]:
        """The active handler first, then the other loaded ones, then those being retired."""
        others = [h for h in self.handlers.values() if h is not self.active]
        return [self.active, *others, *(h for h in self.retiring if h is not self.active)]

    def model_names(self) -> set[str]:
        base = self.model.rstrip("/").split("/")[-1]
        return {self.model, base, "qwen3-tts", "tts-1", "tts-1-hd"}

    def _check_names(self, req: SpeechRequest) -> None:
        if req.model is not None and req.model not in self.model_names():
            raise RequestError(f"model {req.model!r} is not served here; this engine serves "
                               f"{self.model!r}", param="model", status=404)  # fmt: skip
        if req.variant is not None and req.variant not in RECIPES:
            raise RequestError(f"unknown variant {req.variant!r}; valid variants: "
                               f"{', '.join(RECIPES)}", param="variant")  # fmt: skip

    def pick(self, req: SpeechRequest) -> Handler:
        """The handler for `req` right now (the active one unless it names a variant)."""
        self._check_names(req)
        if req.variant is None:
            return self.active
        handler = self.handlers.get(req.variant)
        if handler is None:
            raise RequestError(f"variant {req.variant!r} is not loaded; loaded: "
                               f"{', '.join(self.handlers)}", param="variant")  # fmt: skip
        return handler

    def validate(self, req: SpeechRequest) -> None:
        """Reject, before any waiting, what no handler here can serve."""
        self._check_names(req)
        info = (
            self.pick(req).info
            if req.variant is not None and req.variant != self.pending_variant
            else self.info
        )
        if info:  # before the first model has loaded, the worker's own check is the one
            check_request(req, ModelInfo.from_info(info))

    async def acquire(self, req: SpeechRequest) -> Handler:
        """The handler for `req`, waiting while a break-before-make swap is between handlers."""
        if req.variant is not None and req.variant != self.pending_variant:
            return self.pick(req)
        if not self._serving.is_set():
            if self.gap_waiting >= self.active.max_queue:
                raise RequestError(f"{self.gap_waiting} requests are already waiting for a "
                                   "variant swap", status=429, code=ENGINE_FULL)  # fmt: skip
            self.gap_waiting += 1
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
                # that comes as the awaited thing completes (a client gone as serving resumes)
                async with asyncio.timeout(self.wait_timeout):
                    await self._serving.wait()
            except TimeoutError:
                raise RequestError("no variant came back into service", status=503) from None
            finally:
                self.gap_waiting -= 1
        if self.active.state == "stopped":
            raise RequestError("no variant is loaded (a swap failed)", status=503)
        return self.pick(req)

    async def stream(
        self,
        req: SpeechRequest,
        *,
        ref_audio: bytes | None = None,
        result: Result | None = None,
        text: TextInput | None = None,
    ) -> AsyncIterator[AudioChunk]:
        """Chunks for `req` from the right handler; a request that a handler let go before it
        started (the handler is being swapped out) is routed to the next one, never dropped.
        `text`: a streamed-text request's text, as it arrives."""
        result = result if result is not None else Result()
        t0 = time.perf_counter()
        for _ in range(8):
            handler = await self.acquire(req)
            waited = time.perf_counter() - t0
            chunks = handler.synthesize(req, ref_audio=ref_audio, result=result, text=text)
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        if chunk.index == 0:  # count the wait for a swap as queue wait
                            result.queue_wait_s += waited
                            result.first_audio_s = (result.first_audio_s or 0.0) + waited
                        yield chunk
                return
            except HandlerDraining:
                if result.first_audio_s is not None:
                    raise
                logger.debug("request moved off draining handler %s", handler.name)
        raise HandlerError("no handler would take the request (swaps kept replacing them)")

    def load(
        self, *, swapping: bool = False, started: bool = True, memory: MemoryBand | None = None
    ) -> LoadReport:
        """What this engine takes now (`GET /load`, and `/ready`: ready while `state` is
        serving): streams running and waiting over every handler, the serving handler's real-time
        slots, its state and the governor's memory (held streams, whose client or text is behind,
        lent their slots: counted apart, not as running). `swapping`: the governor is between
        variants (either mode: a router sends new work elsewhere meanwhile); `started`: the
        governor has fixed its ladder; `memory`: its reading and band.

        Free and full: `free_slots` below."""
        handlers = self.all_handlers()
        held = sum(h.held for h in handlers)  # they lent their slots (capacity.py)
        running = sum(h.in_flight for h in handlers) - held
        waiting = sum(h.waiting for h in handlers) + self.gap_waiting
        active = self.active
        if active.state in ("starting", "failed") or not started:
            state = "loading"  # first load, or a worker being restarted
        elif swapping or not self.serving:
            state = "swapping"
        elif active.state != "ready":
            state = "draining"
        else:
            state = "serving"
        slots = active.slots
        budget = active.frame_budget_s
        mem_load = memory.load() if memory is not None else 0.0
        return LoadReport(
            running=running, waiting=waiting, max_batch=active.max_batch, slots=slots,
            free_slots=free_slots(state, slots, running + waiting, mem_load),
            accepting=state in ("serving", "swapping"), state=state,
            underruns=self.retired_underruns + sum(h.underruns for h in handlers),
            frame_budget_ms=None if budget is None else round(budget * 1000, 3),
            step_s={str(n): round(p, 5) for n, p in active.steps.curve(active.max_batch).items()},
            server_load=running + waiting,
            memory_pressure=None if memory is None else round(memory.pressure, 4),
            memory_load=round(mem_load, 4),
            stream_memory_bytes=sum(h.stream_memory for h in handlers),
            stream_memory_budget_bytes=active.memory_budget,
            waiting_for_memory=any(h.waiting_for_memory for h in handlers), held=held,
        )  # fmt: skip

    # -- swap primitives (the governor's) ---------------------------------------------------

    def hold(self, target: str) -> None:
        """Break before make: new requests wait until `route_to` names the next handler."""
        self.pending_variant = target
        self._serving.clear()

    def route_to(self, new: Handler, old: Handler | None = None) -> None:
        """New requests go to `new`; `old` (still working) moves to `retiring`."""
        if old is not None:
            if self.handlers.get(old.variant) is old:
                del self.handlers[old.variant]
            if old.state != "stopped" and old not in self.retiring:
                self.retiring.append(old)
            elif old not in self.retiring:
                self.retired_underruns += old.underruns
        self.handlers[new.variant] = new
        self.active = new
        self.info = new.info or self.info
        self.pending_variant = None
        self._serving.set()

    def forget(self, handler: Handler) -> None:
        """A retired handler has stopped: it leaves the engine."""
        if handler in self.retiring:
            self.retiring.remove(handler)
            self.retired_underruns += handler.underruns

    def resume(self) -> None:
        """End a gap without a new handler (a failed swap): waiting requests get an answer."""
        self.pending_variant = None
        self._serving.set()
