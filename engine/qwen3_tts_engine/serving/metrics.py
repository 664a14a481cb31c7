"""The engine server's Prometheus metrics (one registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_audio = Histogram(
            "qwen3_tts_first_audio_seconds", "Request arrival to first audio chunk", ["variant"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30), registry=r)  # fmt: skip
        self.chunk_compute = Histogram(
            "qwen3_tts_chunk_compute_seconds", "Worker compute per audio chunk", ["variant"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.32, 0.5, 1, 2, 5, 15), registry=r)  # fmt: skip
        self.queue_wait = Histogram(
            "qwen3_tts_queue_wait_seconds", "Time a request waited for its handler", ["variant"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30), registry=r)  # fmt: skip
        self.requests = Counter("qwen3_tts_requests_total", "Speech requests by HTTP status",
                                ["status"], registry=r)  # fmt: skip
        self.active_variant = Gauge("qwen3_tts_active_variant", "1 for the variant serving by default",
                                    ["variant"], registry=r)  # fmt: skip
        self.worker_memory = Gauge("qwen3_tts_worker_memory_bytes", "Handler worker memory",
                                   ["variant", "kind"], registry=r)  # fmt: skip
        self.queue_depth = Gauge("qwen3_tts_queue_depth", "Requests waiting or in flight",
                                 ["variant"], registry=r)  # fmt: skip
        # The memory-pressure governor.
        self.swaps = Counter("qwen3_tts_variant_swaps_total", "Variant swaps",
                             ["direction", "reason", "mode", "result"], registry=r)  # fmt: skip
        self.swap_seconds = Histogram(
            "qwen3_tts_variant_swap_seconds", "Swap decision to the new variant serving", ["mode"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)  # fmt: skip
        self.memory_pressure = Gauge("qwen3_tts_memory_pressure", "Used fraction of the memory "
                                     "limit the governor watches", ["source"], registry=r)  # fmt: skip
        self.memory = Gauge("qwen3_tts_memory_bytes", "The governor's memory reading",
                            ["kind"], registry=r)  # fmt: skip
        self.ladder_position = Gauge("qwen3_tts_ladder_position",
                                     "Rung of the active variant (0 = largest)", registry=r)  # fmt: skip
        # Continuous batching (the worker's scheduler).
        self.active_streams = Gauge("qwen3_tts_active_streams", "Syntheses running in a worker",
                                    ["variant"], registry=r)  # fmt: skip
        self.step_seconds = Gauge("qwen3_tts_step_seconds", "One talker step for all streams "
                                  "(recent steps)", ["variant", "quantile"], registry=r)  # fmt: skip
        self.batch_occupancy = Gauge("qwen3_tts_batch_occupancy", "Mean streams per step / max "
                                     "batch (recent steps)", ["variant"], registry=r)  # fmt: skip
        self.kv_bytes = Gauge("qwen3_tts_kv_cache_bytes", "Talker KV cache of the running "
                              "streams", ["variant", "scope"], registry=r)  # fmt: skip
        self.footprint = Gauge("qwen3_tts_variant_footprint_bytes",
                               "Worker memory per variant (measured or estimated)", ["variant"],
                               registry=r)  # fmt: skip

    def observe_batching(self, variant: str, in_flight: int, stats: dict) -> None:
        self.active_streams.labels(variant).set(in_flight)
        for q in ("p50", "p95"):
            if stats.get(f"step_s_{q}") is not None:
                self.step_seconds.labels(variant, q).set(stats[f"step_s_{q}"])
        if stats.get("batch_occupancy") is not None:
            self.batch_occupancy.labels(variant).set(stats["batch_occupancy"])
        if "kv_bytes" in stats:
            self.kv_bytes.labels(variant, "all").set(stats["kv_bytes"])
            self.kv_bytes.labels(variant, "per_stream").set(stats["kv_bytes_per_stream"])
