"""Smoke runs of the benchmark commands as a user runs them (real subprocesses, tiny
checkpoints, offline assets), with their smallest settings: the JSON has the fields the README
documents and the measured numbers are positive. Speed numbers are not checked against targets;
what a report derives from them (ratios, the goals' verdicts, counts) is checked against them.
Every first-chunk time a bench reports has its first audible sample beside it (the chunk + the
audio's leading silence, as Coval's TTS benchmark counts it), never before it.

`qwen3-tts bench` runs one 4-frame request per measurement and 1 + 1 + 2 HTTP requests
(`--frames 4 --clients 1,2 --repeats 1`); `qwen3-tts bench swap` loads each variant once for
its reference (`--plain-loads 1`) and then swaps 4 times around a 16-frame stream.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent


def _run(exe: str, *args: str, env: dict | None = None, timeout: float = 840) -> dict:
    p = subprocess.run([str(BIN / exe), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})  # fmt: skip
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(p.stdout)  # stdout is the JSON report alone


def _positive(value, what: str) -> None:
    assert isinstance(value, int | float) and not isinstance(value, bool), (what, value)
    assert math.isfinite(value) and value > 0, (what, value)


def _p50_ratio(a: dict, b: dict, column: str) -> float:
    """Two `voice-agent bench` configurations' p50 of `column`, a over b (both must have it)."""
    x, y = a["summary"][column], b["summary"][column]
    assert x and y, (column, x, y)
    return x["p50"] / y["p50"]


def _summary(s: dict, what: str, n: int | None = None) -> None:
    _positive(s["p50"], f"{what}.p50")
    _positive(s["p95"], f"{what}.p95")
    assert s["p95"] >= s["p50"], what
    if n is not None:
        assert s["n"] == n, (what, s["n"])


def _audible(audible: dict, first: dict, what: str) -> None:
    """A first-audible summary beside its first-audio one: the first chunk + leading silence, so
    each of its order statistics is at least the first chunk's (the same requests)."""
    _summary(audible, what, n=first["n"])
    assert audible["p50"] >= first["p50"] and audible["p95"] >= first["p95"], (what, audible, first)


def test_qwen3_tts_bench(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("custom_voice"))
    out = tmp_path / "bench.json"
    report = _run("qwen3-tts", "bench", "--model", model, "--variants", "bf16", "--repeats", "1",
                  "--frames", "4", "--clients", "1,2", "--out", str(out))  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["model"] == model and report["tiny_checkpoint"] is False
    # per variant: load time, worker RSS, first audio, per-chunk compute, real-time factor
    (v,) = report["variants"]
    assert v["variant"] == "bf16" and v["quantized_modules"] == 0
    for key in ("load_s", "start_s", "worker_rss_bytes", "mlx_active_bytes"):
        _positive(v[key], key)
    _summary(v["first_audio_s"], "first_audio_s", n=1)
    _summary(v["chunk_compute_s"], "chunk_compute_s", n=report["frames_per_request"] // 4)
    _summary(v["rtf"], "rtf", n=1)
    # overhead ratio: first audio over HTTP / mlx-audio's own generate()
    _summary(report["direct_first_audio_s"], "direct_first_audio_s", n=1)
    _summary(report["http_first_audio_s"], "http_first_audio_s", n=1)
    _positive(report["overhead_ratio"], "overhead_ratio")
    assert report["overhead_ratio"] == pytest.approx(
        report["http_first_audio_s"]["p50"] / report["direct_first_audio_s"]["p50"]
    )
    # p50/p95 first audio with 1, 2 and 4 clients
    conc = report["concurrency_first_audio_s"]
    assert report["frames_per_request"] == 4 and set(conc) == {"1", "2"}
    for clients, s in conc.items():
        _summary(s, f"concurrency {clients}", n=int(clients))
        _audible(report["concurrency_first_audible_s"][clients], s, f"audible {clients}")
    _audible(report["http_first_audible_s"], report["http_first_audio_s"], "http audible")


def test_qwen3_tts_bench_spawn(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice"))
    report = _run("qwen3-tts", "bench", "spawn", "--model", model, "--repeats", "1")
    assert report["model"] == model and report["repeats"] == 1
    _positive(report["spawn_to_ready_minus_load_s"]["median"], "spawn_to_ready_minus_load_s")
    _positive(report["worker_import_s"], "worker_import_s")
    assert report["worker_import_modules"] > 50  # numpy and the engine modules at least
    assert report["worker_imports_livekit"] is False


def test_qwen3_tts_bench_formats(tiny_checkpoint):
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    report = _run(
        "qwen3-tts", "bench", "formats", "--model", model, "--frames", "4", "--repeats", "1"
    )
    formats = report["formats"]
    assert set(formats) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    assert formats["pcm"]["first_byte_ratio_to_pcm"] == 1.0
    for fmt, f in formats.items():
        _positive(f["first_byte_s"], f"{fmt}.first_byte_s")
        assert f["first_byte_ratio_to_pcm"] == pytest.approx(
            f["first_byte_s"] / formats["pcm"]["first_byte_s"]
        )
        assert f["streamed"] == (fmt != "wav")
        # + the decoded audio's leading silence (an encoder's delay included)
        assert f["first_audible_s"] >= f["first_byte_s"], (fmt, f)
    for fmt in ("mp3", "opus", "aac", "flac"):
        _positive(formats[fmt]["encode_s_per_chunk"], f"{fmt}.encode_s_per_chunk")


def test_qwen3_tts_bench_blas(tiny_checkpoint):
    """`bench blas`, one repeat of 4 frames: three servers (a clean shell, OpenBLAS preloaded,
    the reference BLAS), each one's first audio and first audible sample, and their ratios."""
    model = str(tiny_checkpoint("custom_voice"))
    report = _run("qwen3-tts", "bench", "blas", "--model", model, "--frames", "4", "--repeats", "1")
    servers = {"clean", "ld_preload", "reference"}
    assert set(report["first_audio_s"]) == set(report["first_audible_s"]) == servers
    for name in servers:
        first, audible = report["first_audio_s"][name], report["first_audible_s"][name]
        assert len(first["all"]) == len(audible["all"]) == 1
        _positive(first["p50"], f"{name} first audio")
        assert audible["all"][0] >= first["all"][0], (name, first, audible)
    p50 = {name: report["first_audio_s"][name]["p50"] for name in servers}
    assert report["first_audio_p50_ratio"] == pytest.approx(p50["clean"] / p50["ld_preload"])
    assert report["reference_over_clean_p50"] == pytest.approx(p50["reference"] / p50["clean"])


def test_qwen3_tts_bench_swap(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("custom_voice"))
    out = tmp_path / "swap.json"
    report = _run("qwen3-tts", "bench", "swap", "--model", model, "--plain-loads", "1",
                  "--out", str(out))  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert set(report["plain_load_s"]) == {"bf16", "8bit"}
    for variant, s in report["plain_load_s"].items():
        _positive(s, f"plain_load_s {variant}")
    assert set(report["modes"]) == {"make-before-break", "break-before-make"}
    for mode, m in report["modes"].items():
        _positive(m["baseline_first_audio_s"], f"{mode} baseline")
        assert m["baseline_first_audible_s"] >= m["baseline_first_audio_s"], mode
        for case in ("under_load", "idle"):
            c = m[case]
            # swap latency (decision -> new variant serving) against the plain load time
            for key in ("latency_s", "load_in_swap_s", "plain_load_s", "stop_s"):
                _positive(c[key], f"{mode} {case} {key}")
            assert c["drain_s"] >= 0
            for key in ("latency_minus_drain_minus_plain_load_s", "machinery_overhead_s"):
                assert math.isfinite(c[key]), (mode, case, key)  # differences: either sign
            # worker memory before, at the peak and after
            mem = c["memory_mb"]
            for key in ("active_worker_before", "active_worker_after", "workers_before",
                        "workers_peak", "workers_after"):  # fmt: skip
                _positive(mem[key], f"{mode} {case} memory {key}")
            assert mem["workers_peak"] >= mem["workers_before"]
        assert (m["under_load"]["from"], m["under_load"]["to"]) == ("bf16", "8bit")
        assert (m["idle"]["from"], m["idle"]["to"]) == ("8bit", "bf16")
        # the in-flight stream's chunks and the request that arrived mid-swap
        flight, mid = m["under_load"]["in_flight_stream"], m["under_load"]["mid_swap_request"]
        assert flight["bytes"] == report["long_frames"] * 1920 * 2
        assert mid["bytes"] == report["short_frames"] * 1920 * 2
        for r in (flight, mid):
            assert r["complete"] and r["lost_chunks"] == 0 and r["error"] is None
            _positive(r["first_audio_s"], f"{mode} first audio")
            assert r["first_audible_s"] >= r["first_audio_s"], (mode, r)
        _positive(flight["max_chunk_gap_s"], f"{mode} max chunk gap")
        assert math.isfinite(mid["extra_wait_s"])
    assert report["lost_chunks"] == 0 and report["truncated_or_failed_requests"] == 0
    goal = report["goal"]
    assert set(goal) == {"latency_within_plain_load_plus_100ms", "machinery_overhead_under_100ms",
                         "zero_lost_or_truncated_chunks"}  # fmt: skip
    assert goal["zero_lost_or_truncated_chunks"] is True
    # The speed goals' verdicts are the machine's business; each is the bench's own comparison
    # of what it measured, one per swap (both modes, under load and idle).
    cases = {f"{mode} {case}": m[case] for mode, m in report["modes"].items()
             for case in ("under_load", "idle")}  # fmt: skip
    assert len(cases) == 4
    for name, c in cases.items():
        drain = c["drain_s"] if name.startswith("break-before-make") else 0.0  # waited by design
        assert c["latency_minus_drain_minus_plain_load_s"] == pytest.approx(
            c["latency_s"] - drain - c["plain_load_s"]
        ), name
        assert c["machinery_overhead_s"] == pytest.approx(
            c["latency_s"] - drain - c["load_in_swap_s"]
        ), name
    assert goal["latency_within_plain_load_plus_100ms"] == {
        name: c["latency_minus_drain_minus_plain_load_s"] <= 0.1 for name, c in cases.items()
    }
    assert goal["machinery_overhead_under_100ms"] == {
        name: c["machinery_overhead_s"] <= 0.1 for name, c in cases.items()
    }


def test_voice_agent_bench(tmp_path):
    # offline: the bundled tiny.en STT, a generated tiny LLM (mlx_lm.server), the default tiny
    # TTS checkpoint in this session's QWEN3_TTS_CACHE; 4 frames per sentence, short replies;
    # one plain and one paused question, with the tuned and with the baseline settings
    report = _run("voice-agent", "bench", "--turns", "1", "--paused-turns", "1", "--tts-requests", "1",
                  "--offline", "--tts-max-new-tokens", "4", "--llm-max-tokens", "4",
                  "--out", str(tmp_path / "va.json"),
                  env={"VOICE_AGENT_CACHE": str(tmp_path / "va"), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert json.loads((tmp_path / "va.json").read_text()) == report
    assert any("RANDOM" in n for n in report["notes"])
    settings = report["settings"]
    assert settings["baseline"] == {"stt_streaming": False, "stt_encoder_context": 30.0, "stt_final_silence": 0.3,
                                    "vad_min_silence": 0.55, "endpointing_min_delay": 0.5,
                                    "endpointing_max_delay": 3.0, "turn_detector": "none",
                                    "preemptive_generation": False, "preemptive_tts": False,
                                    "tts_first_clause_words": 0,
                                    "tts_first_clause_chunk_frames": 4,
                                    "tts_text_input": "sentences"}  # fmt: skip
    assert (
        settings["tuned"]["turn_detector"] == "rule" and settings["tuned"]["preemptive_generation"]
    )
    # clause mode: the tuned settings but the reply's text as sentences (first clause ahead)
    assert settings["tuned"]["tts_text_input"] == "auto"
    assert settings["clause"] == {**settings["tuned"], "tts_text_input": "sentences"}
    for name in ("tuned", "clause", "baseline"):
        config = report[name]
        turns = config["turns"]
        assert [t["kind"] for t in turns] == ["plain", "paused"]
        assert turns[1]["pause_s"] == report["paused_set"][0]["pause_s"] > 0
        # The random LLM may answer nothing speakable (about 1 reply in 2000 here): such a turn
        # is silent, counted as such, and has no reply (no message with LiveKit's LLM and TTS
        # times). The rest are timed in full.
        silent = [t for t in turns if t["silent"]]
        voiced = [t for t in turns if not t["silent"]]
        assert config["silent_turns"] == len(silent), (name, config["silent_turns"], silent)
        for turn in silent:
            assert turn["llm_ttft_s"] is None and turn["tts_ttfb_s"] is None, turn
            assert turn["llm_requests"] >= 1, turn
        assert voiced, f"{name}: every turn was silent: {turns}"
        for turn in voiced:
            for key in ("voice_to_voice_s", "llm_ttft_s", "llm_ttfs_s", "tts_ttfb_s",
                        "tts_first_chunk_compute_s"):  # fmt: skip
                _positive(turn[key], key)
            # The end of speech is the caller's last sample; LiveKit's delays count from the VAD's,
            # which Silero dates at most 0.5 s before it. On one clock the VAD's end of speech
            # comes before the turn is committed, and that before the reply's first audio (how
            # long after is the machine's business).
            lag = turn["vad_end_lag_s"]
            assert -0.5 < lag <= turn["end_of_turn_s"] <= turn["voice_to_voice_s"], turn
            assert turn["end_of_turn_s"] == pytest.approx(turn["end_of_turn_delay_s"] + lag)
            # what the glue adds: voice-to-voice less the end of turn, the LLM's time to its first
            # sentence and the TTS's first chunk; with preemptive generation only the time after
            # the commit counts, at most all of it from the final transcript on
            eot, tts = turn["end_of_turn_s"], turn["tts_first_chunk_compute_s"]
            preemptive = settings[name]["preemptive_generation"]
            lead = max(0.0, eot - (turn["transcription_s"] or 0.0)) if preemptive else 0.0
            tts_early = preemptive and settings[name]["preemptive_tts"]
            early, late = (
                (turn["llm_ttfs_s"] + tts, 0.0) if tts_early else (turn["llm_ttfs_s"], tts)
            )
            added = turn["voice_to_voice_s"] - eot - max(0.0, early - lead) - late
            assert turn["added_s"] == pytest.approx(added), turn
            first = turn["llm_ttfs_s"] - turn["llm_ttft_s"] + turn["tts_ttfb_s"]  # LiveKit's
            assert turn["llm_first_token_to_audio_s"] == pytest.approx(first)
            assert 1 <= turn["llm_requests"] and 0 <= turn["llm_wasted"] < turn["llm_requests"]
            assert 0 <= turn["tts_wasted"] <= turn["tts_requests"]
        assert set(config["ended_early"]) == {"plain", "paused"}
        summary = config["summary"]["voice_to_voice_s"]
        assert summary["n"] == len(voiced) and summary["p95"] >= summary["p50"] > 0, summary
    # tuned over baseline, and streamed text (tuned) over clause mode: each p50 ratio as measured
    ratios = {
        "end_of_turn_p50": "end_of_turn_s",
        "transcription_p50": "transcription_s",
        "voice_to_voice_p50": "voice_to_voice_s",
        "livekit_end_of_turn_delay_p50": "end_of_turn_delay_s",
    }
    assert set(report["ratios"]) == set(ratios)
    for key, column in ratios.items():
        expected = _p50_ratio(report["tuned"], report["baseline"], column)
        assert expected > 0 and report["ratios"][key] == pytest.approx(expected), key
    vs_clause = report["streaming_vs_clause"]
    assert vs_clause["text_streamed"] is True
    assert vs_clause["ended_early"] == {"tuned": report["tuned"]["ended_early"],
                                        "clause": report["clause"]["ended_early"]}  # fmt: skip
    for key, column in (("llm_first_token_to_audio_p50", "llm_first_token_to_audio_s"),
                        ("voice_to_voice_p50", "voice_to_voice_s")):  # fmt: skip
        expected = _p50_ratio(report["tuned"], report["clause"], column)
        assert expected > 0 and vs_clause[key] == pytest.approx(expected), key
    # the plain question's transcript, tuned against baseline
    wer = report["plain_transcript_wer_vs_baseline"]
    assert isinstance(wer, int | float) and wer >= 0, wer
    assert (
        report["goals"]["end_of_turn_p50_ratio"] == 0.5 and report["goals"]["added_p95_s"] == 0.060
    )
    # TTS first audio while the LLM generates / idle
    _summary(report["tts_first_audio_idle_s"], "tts idle", n=1)
    _summary(report["tts_first_audio_llm_busy_s"], "tts busy", n=1)
    _audible(report["tts_first_audible_idle_s"], report["tts_first_audio_idle_s"], "idle audible")
    _audible(
        report["tts_first_audible_llm_busy_s"], report["tts_first_audio_llm_busy_s"], "busy audible"
    )
    _positive(report["llm_stream_lines_during_busy"], "llm lines")
    _positive(report["contention_ratio"], "contention_ratio")
    assert report["contention_ratio"] == pytest.approx(
        report["tts_first_audio_llm_busy_s"]["p50"] / report["tts_first_audio_idle_s"]["p50"]
    )
    assert report["goal_ratio"] == 1.3


def test_qwen3_tts_bench_concurrency_codes_only(tiny_checkpoint):
    """`--codes-only` (for a real-size model on a CPU): the codes paths, no vocoder, no server;
    `--real-size` with `--model` is refused before anything loads."""
    model = str(tiny_checkpoint("custom_voice"))
    report = _run("qwen3-tts", "bench", "concurrency", "--model", model, "--streams", "1,2",
                  "--frames", "4", "--repeats", "1", "--codes-only")  # fmt: skip
    assert set(report["paths"]) == set(report["ratios"]) == {"codes", "codes_unbatched"}
    assert report["paths"]["codes"]["2"]["determinism"]["streams_with_other_codes"] == 0
    # the default compute dtype (auto) as resolved on this CPU
    assert report["compute_dtype"] == "float32" and "server_compute_dtype" not in report
    p = subprocess.run([str(BIN / "qwen3-tts"), "bench", "concurrency", "--real-size", "--model", model],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "--real-size and --model" in p.stderr and not p.stdout


def test_qwen3_tts_bench_concurrency(tiny_checkpoint):
    """`bench concurrency` at 1 and 2 streams, 4 frames each, one repeat, all three paths, with
    the weights' own compute dtype (the in-process model and the server's worker both load so)."""
    model = str(tiny_checkpoint("custom_voice"))
    report = _run("qwen3-tts", "bench", "concurrency", "--model", model, "--streams", "2,1",
                  "--frames", "4", "--repeats", "1", "--compute-dtype", "weights")  # fmt: skip
    assert report["streams"] == [1, 2] and report["frames_per_stream"] == 4
    assert report["compute_dtype"] == report["server_compute_dtype"] == "weights"
    for path in ("codes", "codes_unbatched", "full", "http"):
        for n in (1, 2):
            level = report["paths"][path][str(n)]
            # one stream runs twice: each level's p95 over as many streams as the largest's
            _summary(level["first_audio_s"], f"{path} {n} first_audio_s", n=2)
            _summary(level["rtf_per_stream"], f"{path} {n} rtf_per_stream", n=2)
            _positive(level["frames_per_s"], f"{path} {n} frames_per_s")
            if path in ("full", "http"):  # audio: its first audible sample; the codes have none
                _audible(level["first_audible_s"], level["first_audio_s"], f"{path} {n} audible")
            else:
                assert "first_audible_s" not in level
        assert report["ratios"][path]["1"] == {
            "first_audio_p95_ratio": 1.0,
            "frames_per_s_ratio": 1.0,
        }
        _positive(report["ratios"][path]["2"]["first_audio_p95_ratio"], f"{path} ratio")
    # the same seeded requests batched and one by one: every stream is compared
    assert report["paths"]["codes"]["2"]["determinism"]["streams"] == 2
    assert 0 <= report["paths"]["full"]["2"]["vocoder_share"] <= 1
    assert set(report["paths"]["http"]["2"]["server_step_s"]) == {
        "step_s_p50",
        "step_s_p95",
        "batch_occupancy",
    }
    # the sizing `serve` would admit by: slots follow from the steps the server measured
    sizing = report["realtime_slots"]
    assert sizing["frame_budget_ms"] == 80 and 1 <= sizing["slots"] <= 2
    # a 2-row step is measured only if the two 4-frame streams shared a step, which a busy
    # machine need not give (one ended before the other joined); the model predicts every size
    assert "1" in sizing["measured_step_s"] and set(sizing["measured_step_s"]) <= {"1", "2"}
    assert set(sizing["step_s"]) == {"1", "2"}
    fits = [n for n in (2,) if sizing["step_s"][str(n)] <= 0.08]
    assert sizing["slots"] == (2 if fits else 1)


def test_voice_agent_bench_fleet(tiny_checkpoint, tmp_path):
    """Two engines pinned to cores, 3 streams per phase, one run of each configuration (HTTP
    sentences, and the plugin's default text input: streamed text over the socket): priority
    keeps them all on the first engine (nothing is full: its queue takes them), and the churn phase
    (first engine SIGKILLed, a third added) loses no stream. Where balanced puts its three is not
    asserted: it follows the engines' load reports, which a busy machine makes arrive at other
    moments (a fresh clone saw all three on one engine; tests/plugins/qwen3_tts/test_balancing.py
    tests the balancer). Slots come from each engine's
    `/load` during and after the traffic; the spread over runs is each run's ratio."""
    out = tmp_path / "fleet.json"
    report = _run("voice-agent", "bench", "fleet", "--engines", "2", "--streams", "3", "--gap", "0",
                  "--frames", "4", "--engine-max-batch", "2", "--runs", "1",
                  "--engine-model", str(tiny_checkpoint("custom_voice")), "--out", str(out),
                  env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["nproc"] == os.cpu_count() and len(report["loadavg_start"]) == 3
    assert report["goal"] == {"balanced_over_priority_p95_max": 0.6, "lost": 0}
    configs = report["configurations"]
    assert set(configs) == {"sentences", "stream"}
    assert configs["sentences"]["text_input"] == "sentences"
    assert configs["stream"]["text_input"] == "default"
    for name, c in configs.items():
        (run,) = c["runs"]
        first, second = run["priority"]["per_engine"]
        assert run["priority"]["per_engine"] == {first: 3, second: 0}, name
        for phase in ("priority", "balanced", "churn"):
            s = run[phase]
            assert s["lost"] == 0 and s["streams"] == 3, (name, phase, s)
            assert sum(s["per_engine"].values()) == 3, (name, phase, s)
            # the default text input streams where the engine takes it (this one does)
            assert s["text_streamed"] == (3 if name == "stream" else 0), (name, phase, s)
            _positive(s["first_audio_p50_s"], f"{name}.{phase}.p50")
            assert s["first_audio_p95_s"] >= s["first_audio_p50_s"]
            assert s["first_audible_p50_s"] >= s["first_audio_p50_s"], (name, phase, s)
            assert s["first_audible_p95_s"] >= s["first_audio_p95_s"], (name, phase, s)
        for phase in ("priority", "balanced"):  # /load over the phase: underruns, slots
            s = run[phase]
            assert set(s["underruns"]) == set(s["slots_after"]) == {first, second}
            assert all(isinstance(n, int) and n >= 0 for n in s["underruns"].values())
            for slots in (s["slots_after"], s["slots_max_during"]):  # measured, within max-batch
                assert all(isinstance(n, int) and 1 <= n <= 2 for n in slots.values()), s
        churn = run["churn"]
        assert churn["killed"] == first and churn["added"] not in (first, second)
        assert churn["underruns"][first] is None and churn["slots_after"][first] is None
        assert run["offered_streams_at_once"] is None  # --gap 0: all at once
        ratio = run["balanced_over_priority_p95"]
        _positive(ratio, f"{name} ratio")
        assert ratio == pytest.approx(
            run["balanced"]["first_audio_p95_s"] / run["priority"]["first_audio_p95_s"]
        )
        assert c["balanced_over_priority_p95"] == {
            "min": ratio,
            "median": ratio,
            "max": ratio,
            "n": 1,
        }
        assert c["lost"] == 0 and c["goal_met_every_run"] == (ratio <= 0.6)


def test_qwen3_tts_bench_first_chunk(tiny_checkpoint):
    """`bench first-chunk`, one repeat, 8 frames: every mode and size; a sentence's first chunk
    is the size asked; the streamed audio is the one-shot decode of the same codes (no seams)."""
    model = str(tiny_checkpoint("custom_voice", eos="text"))
    report = _run("qwen3-tts", "bench", "first-chunk", "--model", model, "--frames", "8",
                  "--repeats", "1", "--tokens-per-s", "200")  # fmt: skip
    for mode in ("sentences", "stream", "stream_fast_llm"):
        assert set(report[mode]) == {"1", "2", "4"}, mode
        for size, row in report[mode].items():
            for key in ("first_audio_engine_s", "first_audio_from_llm_s", "compute_s"):
                _positive(row[key], f"{mode}.{size}.{key}")
            assert row["first_audio_from_llm_s"] >= row["first_audio_engine_s"]
            assert row["first_audible_engine_s"] >= row["first_audio_engine_s"]
            assert sum(row["chunk_frames"]) == row["frames"] > 0  # the cap is per sentence
            assert max(row["chunk_frames"]) <= 4 and row["chunk_frames"][0] <= int(size)
            # float rounding only: well under one int16 step at the joins and elsewhere
            assert 0 <= row["seam_max_abs_int16"] < 1 and 0 <= row["elsewhere_max_abs_int16"] < 1
            assert row["gaps_s"] >= 0
        assert report[mode]["4"]["first_audio_vs_4"] == 1.0
    assert [report["sentences"][s]["chunk_frames"][0] for s in ("1", "2", "4")] == [1, 2, 4]


def test_voice_agent_bench_paced_llm(tmp_path):
    """`voice-agent bench --llm-pace`: the LLM is the paced stand-in (no mlx_lm); per text mode
    the reply's first words on one clock. Keys and orderings only: the first audible sample
    after the first audio, the reply's start after the LLM's first token, the engine's own
    socket figure within the agent's, and every stage of the breakdown after the one before."""
    report = _run("voice-agent", "bench", "--offline", "--llm-pace", "200", "--llm-first-token-ms", "20",
                  "--turns", "1", "--paused-turns", "0", "--tts-requests", "1", "--json",
                  env={"VOICE_AGENT_CACHE": str(tmp_path / "va"), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert report["llm_pace"] == {"tokens_per_s": 200.0, "first_token_s": 0.02}
    assert any("paced stand-in" in n for n in report["notes"])
    modes = report["text_modes"]
    assert set(modes) == {"stream", "clause"}
    for mode, config in (("stream", "tuned"), ("clause", "clause")):
        m = modes[mode]
        first, audible = (
            m["llm_first_token_to_first_audio_s"],
            m["llm_first_token_to_first_audible_s"],
        )
        _summary(first, f"{mode} first audio", n=1)
        _audible(audible, first, f"{mode} audible")
        _audible(m["reply_start_to_first_audible_s"], m["reply_start_to_first_audio_s"], mode)
        assert 0 < m["reply_start_to_first_audio_s"]["p50"] <= first["p50"], m
        assert m["held_for_commit"] in (0, 1)
        (turn,) = report[config]["turns"]
        spans = turn["first_words_ms"]
        assert set(spans) == set(m["stages_median_ms"]) == {
            "llm_transport", "held_for_commit", "reply_start_to_tts_node", "tts_node_to_text_in",
            "text_in_to_socket", "socket_to_first_frame", "first_frame_to_output"}  # fmt: skip
        for name in ("llm_transport", "held_for_commit", "tts_node_to_text_in",
                     "text_in_to_socket", "socket_to_first_frame", "first_frame_to_output"):  # fmt: skip
            assert spans[name] >= 0, (mode, name, spans)
        engine = turn["engine_socket_first_audio_s"]
        if mode == "stream":  # the engine's own (its socket: text in -> first chunk), inside ours
            assert 0 < engine <= turn["llm_first_token_to_first_audio_s"], turn
        else:
            assert engine is None  # sentences: no socket
    ratios = report["text_modes_stream_over_clause_p50"]
    assert ratios["llm_first_token_to_first_audio_s"] == pytest.approx(
        modes["stream"]["llm_first_token_to_first_audio_s"]["p50"]
        / modes["clause"]["llm_first_token_to_first_audio_s"]["p50"]
    )


def test_voice_agent_bench_fleet_load_sweep(tiny_checkpoint, tmp_path):
    """`bench fleet --loads`: per load, a priority / balanced pair whose gap offers that many of
    one engine's slots at once (Little's law over the solo phase's time in the fleet), no churn;
    keys, the derived numbers and the orderings only."""
    report = _run("voice-agent", "bench", "fleet", "--engines", "2", "--streams", "3", "--frames", "4",
                  "--engine-max-batch", "2", "--runs", "1", "--paths", "stream", "--loads", "0.5,1.5",
                  "--engine-model", str(tiny_checkpoint("custom_voice")),
                  env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert report["loads"] == [0.5, 1.5] and set(report["configurations"]) == {"stream"}
    c = report["configurations"]["stream"]
    (run,) = c["runs"]
    assert "churn" not in run and "priority" not in run  # the sweep's pairs instead
    one = run["one_engine_slots"]
    assert isinstance(one, int) and 1 <= one <= 2
    assert set(run["sweep"]) == set(c["sweep"]) == {"0.5", "1.5"}
    for key, row in run["sweep"].items():
        assert row["load"] == float(key) and row["gap_s"] > 0
        assert row["offered_streams_at_once"] == pytest.approx(row["load"] * one)
        for phase in ("priority", "balanced"):
            s = row[phase]
            assert s["lost"] == 0 and s["streams"] == 3 and s["text_streamed"] == 3, s
            assert s["first_audible_p95_s"] >= s["first_audio_p95_s"] > 0, s
        ratio = row["balanced_over_priority_p95"]
        assert ratio == pytest.approx(
            row["balanced"]["first_audio_p95_s"] / row["priority"]["first_audio_p95_s"]
        )
        summary = c["sweep"][key]
        assert summary["balanced_over_priority_p95"]["median"] == ratio
        assert summary["lost"] == 0
        assert summary["goal_met_every_run"] == (None if row["load"] <= 1 else ratio <= 0.6)
    assert c["lost"] == 0
