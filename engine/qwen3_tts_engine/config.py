"""One typed configuration an engine server is built from, and the one function that builds it.

`qwen3-tts serve` fills an `EngineConfig` from its flags (`cli.py`); the benchmarks, the demo and
the voice agent's in-process engine build theirs in code. `build_server` turns any of them into
an `EngineServer`: the handlers (one worker process per variant), the engine that routes between
them, the memory governor and the HTTP server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qwen3_tts_engine.dispatch.capacity import default_frame_budget
from qwen3_tts_engine.dispatch.engine import Engine
from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.governor.governor import Governor
from qwen3_tts_engine.governor.memory import MemoryProbe, detect_probe
from qwen3_tts_engine.governor.policy import Policy
from qwen3_tts_engine.models.memory_plan import SERVER_BYTES, SPARE_WORKER_BYTES
from qwen3_tts_engine.protocol import DEFAULT_MAX_BATCH, check_compute_dtype
from qwen3_tts_engine.serving.app import EngineServer, ServerConfig


@dataclass
class GovernorConfig:
    """The memory governor: its policy (ladder and thresholds) and how it runs."""

    policy: Policy = field(default_factory=Policy)
    memory_source: str = "auto"  # detect_probe's sources: auto, cgroup, psutil, macos
    probe: MemoryProbe | None = None  # a probe object instead of memory_source (tests, benches)
    interval_s: float = 1.0
    drain_deadline_s: float | None = None
    auto: bool = True  # False: it watches and reports, and swaps only when the operator asks
    allow_unevaluated: Sequence[str] = ()
    quality_budget: dict | None = None
    quality_min_items: int = 6
    spare_worker: bool = False


@dataclass
class EngineConfig:
    """An engine server: the model, its variants and the handlers' options, the HTTP server's
    options, and the governor (None: none runs, as in the benchmarks)."""

    model: str
    variants: Sequence[str | None] = (
        None,
    )  # loaded at start; the first serves (None: the model's own)
    max_batch: int = DEFAULT_MAX_BATCH
    max_queue: int = 32
    compute_dtype: str | None = None  # None: the weights' dtype; "auto": float32 on a CPU
    warmup: bool = True
    # the longest a batch step may take for a stream to be admitted (None: no budget, max_batch
    # streams); default $QWEN3_TTS_FRAME_BUDGET_MS or 80 ms (dispatch/capacity.py)
    frame_budget_s: float | None = field(default_factory=default_frame_budget)
    step_delay_s: float = 0.0  # fault injection: sleep per stream per batch step
    loop_detector: bool = True  # end looping sentences as "repetition" (worker/loop_detector.py)
    # The memory a worker's streams may hold, for admission (dispatch/capacity.py): bytes; None:
    # no memory rule; "auto": with a governor, the worker may use its policy's `downgrade_at` x
    # its memory limit less the server process and the spare worker (`worker_budget`), so that
    # streams wait before the governor would swap; without one, no rule.
    stream_memory: int | str | None = "auto"
    server: ServerConfig = field(default_factory=ServerConfig)
    governor: GovernorConfig | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("an engine needs a model (a hub id or a checkpoint directory)")
        if not self.variants:
            raise ValueError("an engine needs at least one variant (None: the model's own)")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        check_compute_dtype(self.compute_dtype)
        if isinstance(self.stream_memory, str) and self.stream_memory != "auto":
            raise ValueError(f"stream_memory: bytes, None or 'auto', got {self.stream_memory!r}")

    def handler(self, variant: str | None, worker_memory_bytes: int | None = None) -> Handler:
        streams = self.stream_memory if isinstance(self.stream_memory, int) else None
        return Handler(self.model, variant, warmup=self.warmup, max_queue=self.max_queue,
                       max_batch=self.max_batch, compute_dtype=self.compute_dtype,
                       frame_budget_s=self.frame_budget_s, step_delay_s=self.step_delay_s,
                       loop_detector=self.loop_detector, stream_memory_bytes=streams, worker_memory_bytes=worker_memory_bytes)  # fmt: skip


def worker_budget(limit_bytes: int, policy: Policy, spare_worker: bool) -> int:
    """What one worker may use (`stream_memory="auto"`): the governor's downgrade watermark of
    the memory limit, less the server process and the spare worker (models/memory_plan.py)."""
    others = SERVER_BYTES + (SPARE_WORKER_BYTES if spare_worker else 0)
    return max(0, int(policy.downgrade_at * limit_bytes) - others)


def build_server(config: EngineConfig) -> EngineServer:
    """An unstarted server for `config` (`await server.start()` binds, then loads the models)."""
    g = config.governor
    probe = None if g is None else g.probe if g.probe is not None else detect_probe(g.memory_source)
    worker = None
    if g is not None and config.stream_memory == "auto":
        worker = worker_budget(probe.read().limit_bytes, g.policy, g.spare_worker)
    engine = Engine(config.model, [config.handler(v, worker) for v in config.variants])
    governor = None
    if g is not None:
        governor = Governor(engine, probe, g.policy, interval_s=g.interval_s,
                            drain_deadline_s=g.drain_deadline_s, auto=g.auto,
                            allow_unevaluated=g.allow_unevaluated, quality_budget=g.quality_budget,
                            quality_min_items=g.quality_min_items, spare_worker=g.spare_worker)  # fmt: skip
    return EngineServer(engine, config.server, governor)
