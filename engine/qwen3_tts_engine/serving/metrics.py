"""The engine server's Prometheus metrics (one registry per server).

Load is exported three times: under the engine's own names (`qwen3_tts_slots`, ...), under the
names vLLM (and vLLM-Omni) exports and llm-d's endpoint picker reads (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) and under SGLang's (SGLang-Omni's) names
for the same (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`), so a
router scores this engine as it scores a vLLM or SGLang pod (docs/fleet.md). This engine's KV budget is its batch slots, so its
"KV-cache usage" is batch-slot utilisation: running streams / real-time slots.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qwen3_tts_engine.protocol import FINISH_REASONS, LOAD_STATES, LoadReport


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
        # WebSockets (both protocols): a call of several replies is one connection
        self.socket_connections = Counter("qwen3_tts_socket_connections", "WebSocket connections "
                                          "accepted", ["protocol"], registry=r)  # fmt: skip
        self.socket_utterances = Histogram(
            "qwen3_tts_socket_utterances", "Utterances one WebSocket carried (observed at its "
            "close)", ["protocol"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128), registry=r)  # fmt: skip
        self.capped = Counter("qwen3_tts_utterances_capped_total", "Utterances that ran to their "
                              "frame cap (no end-of-speech)", ["variant"], registry=r)  # fmt: skip
        # every utterance once, on every door, by why it ended (speech_service.observe_finish)
        self.finished = Counter("qwen3_tts_utterances_finished_total", "Utterances by why they "
                                "ended (protocol.FINISH_REASONS)", ["reason"], registry=r)  # fmt: skip
        for reason in FINISH_REASONS:  # each reason's series exists from the start (rate() of 0)
            self.finished.labels(reason)
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
        self.batch_step = Histogram(
            "qwen3_tts_batch_step_seconds", "One batch step (a frame for every stream in it), by "
            "streams in the step", ["variant", "streams"],
            buckets=(0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.4, 1, 2.5), registry=r)  # fmt: skip
        # Load (GET /load): the engine's names, then vLLM's (llm-d's scorers read these).
        m = ["model_name"]
        self.running = Gauge("qwen3_tts_requests_running", "Streams admitted and not finished", m,
                             registry=r)  # fmt: skip
        self.waiting = Gauge(
            "qwen3_tts_requests_waiting", "Requests queued for a slot", m, registry=r
        )
        self.max_batch = Gauge("qwen3_tts_max_batch", "Configured batch rows", m, registry=r)
        self.slots = Gauge("qwen3_tts_slots", "Streams kept in real time now (measured step time "
                           "vs the frame budget)", m, registry=r)  # fmt: skip
        self.free_slots = Gauge("qwen3_tts_free_slots", "Slots neither running nor promised to a "
                                "waiting request (0 unless serving)", m, registry=r)  # fmt: skip
        self.accepting = Gauge(
            "qwen3_tts_accepting", "1 while new requests are taken", m, registry=r
        )
        self.state = Gauge("qwen3_tts_state", "1 for the engine's state", [*m, "state"], registry=r)
        self.underruns = Counter("qwen3_tts_underruns", "Chunks made after the moment their "
                                 "listener needed them", m, registry=r)  # fmt: skip
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests running (vLLM's name: "
                                  "streams in the batch)", m, registry=r)  # fmt: skip
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (vLLM's name: "
                                  "queued for a slot)", m, registry=r)  # fmt: skip
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage 0..1 (vLLM's name; "
                                   "here batch-slot utilisation: running / slots)", m, registry=r)  # fmt: skip
        # SGLang's names for the same three (SGLang-Omni serves them; routers with an sglang
        # engine type read these)
        self.sglang_running = Gauge("sglang:num_running_reqs", "Running requests (SGLang's name: "
                                    "streams in the batch)", m, registry=r)  # fmt: skip
        self.sglang_waiting = Gauge("sglang:num_queue_reqs", "Requests in the waiting queue "
                                    "(SGLang's name: queued for a slot)", m, registry=r)  # fmt: skip
        self.sglang_token_usage = Gauge("sglang:token_usage", "KV token usage 0..1 (SGLang's name; "
                                        "here batch-slot utilisation: running / slots)", m,
                                        registry=r)  # fmt: skip
        self._underruns_seen: dict[str, int] = {}

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

    def observe_steps(self, variant: str, steps: list[tuple[int, float]]) -> None:
        for streams, seconds in steps:
            self.batch_step.labels(variant, str(streams)).observe(seconds)

    def observe_load(self, model: str, load: LoadReport) -> None:
        self.running.labels(model).set(load.running)
        self.waiting.labels(model).set(load.waiting)
        self.max_batch.labels(model).set(load.max_batch)
        self.slots.labels(model).set(load.slots)
        self.free_slots.labels(model).set(load.free_slots)
        self.accepting.labels(model).set(1 if load.accepting else 0)
        for state in LOAD_STATES:
            self.state.labels(model, state).set(1 if state == load.state else 0)
        seen = self._underruns_seen.get(model, 0)
        if load.underruns > seen:
            self.underruns.labels(model).inc(load.underruns - seen)
        self._underruns_seen[model] = max(seen, load.underruns)
        usage = min(1.0, load.running / load.slots) if load.slots else 0.0
        for running, waiting, kv in ((self.vllm_running, self.vllm_waiting, self.vllm_kv_usage),
                                     (self.sglang_running, self.sglang_waiting,
                                      self.sglang_token_usage)):  # fmt: skip
            running.labels(model).set(load.running)
            waiting.labels(model).set(load.waiting)
            kv.labels(model).set(usage)
