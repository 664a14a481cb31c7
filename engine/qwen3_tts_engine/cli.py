"""`qwen3-tts` command line: tiny-checkpoint, serve, variant, say, bench, demo, quantize, eval, ablate.

Everything but `say --server` runs mlx-audio (installed with the package on macOS and Linux).
Each command imports what it needs when it runs (the function-local imports below): `--help`,
`say --server` and `variant` start without mlx, and `serve` keeps mlx out of the server process
(its workers load it, `dispatch/launch.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path

from qwen3_tts_engine.audio import pcm16, write_wav
from qwen3_tts_engine.dispatch.capacity import BUDGET_ENV, parse_budget_ms
from qwen3_tts_engine.fast_blas import use_fast_blas
from qwen3_tts_engine.open_files import import_mlx_lm
from qwen3_tts_engine.protocol import (
    COMPUTE_CHOICES,
    DEFAULT_MAX_BATCH,
    DEFAULT_TEXT_PACE,
    DEFAULT_TEXT_START_TOKENS,
    MAX_TEXT_START_TOKENS,
    MIN_TEXT_PACE,
    SAMPLE_RATE,
    EngineStatus,
    RequestError,
    SpeechRequest,
    VariantChange,
    check_input,
    compute_dtype_option,
    normalize_language,
)
from qwen3_tts_engine.serving.auth import API_KEY_ENV, OPERATOR_KEY_ENV, bearer_header
from qwen3_tts_engine.tiny_checkpoints import TINY_WARNING, default_tiny_checkpoint

# environment defaults of `serve --text-start-tokens / --text-pace` (a flag wins)
TEXT_START_TOKENS_ENV = "QWEN3_TTS_TEXT_START_TOKENS"
TEXT_PACE_ENV = "QWEN3_TTS_TEXT_PACE"


def _need_mlx() -> None:
    try:
        import mlx_audio  # noqa: F401
    except ImportError:
        sys.exit("qwen3-tts: error: this command needs mlx-audio: "
                 "pip install qwen3-tts-engine")  # fmt: skip


# -- tiny-checkpoint --------------------------------------------------------------------------


def cmd_tiny_checkpoint(args: argparse.Namespace) -> int:
    _need_mlx()
    from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint

    t0 = time.perf_counter()
    out = write_tiny_checkpoint(args.out, variant=args.variant, bits=args.bits, seed=args.seed,
                                eos=args.eos)  # fmt: skip
    size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    print(f"wrote {args.variant} tiny checkpoint ({size / 1e6:.1f} MB) to {out} "
          f"in {time.perf_counter() - t0:.1f}s")  # fmt: skip
    return 0


# -- serve ------------------------------------------------------------------------------------


def engine_config(args: argparse.Namespace):
    """The `EngineConfig` that `serve`'s flags describe."""
    from qwen3_tts_engine.config import EngineConfig, GovernorConfig
    from qwen3_tts_engine.governor.budget import load_budget
    from qwen3_tts_engine.governor.policy import Policy
    from qwen3_tts_engine.protocol import Limits
    from qwen3_tts_engine.serving.app import ServerConfig

    ladder = tuple(v.strip() for v in args.ladder.split(",") if v.strip())
    policy = Policy(ladder=ladder, downgrade_at=args.downgrade_at, upgrade_at=args.upgrade_at,
                    downgrade_hold_s=args.downgrade_hold, upgrade_hold_s=args.upgrade_hold,
                    cooldown_s=args.cooldown, critical_at=args.critical_at, mode=args.swap_mode)  # fmt: skip
    server = ServerConfig(
        host=args.host, port=args.port, api_key=os.environ.get(API_KEY_ENV) or None,
        operator_key=os.environ.get(OPERATOR_KEY_ENV) or None, insecure_no_auth=args.insecure_no_auth,
        allow_fault_injection=args.allow_fault_injection,
        ref_audio_dir=Path(args.ref_audio_dir) if args.ref_audio_dir else None,
        limits=Limits(max_input_chars=args.max_input_chars), max_queue=args.max_queue,
        text_start_tokens=args.text_start_tokens, text_pace=args.text_pace,
        max_sessions=args.max_sessions, ws_first_text_timeout_s=args.ws_first_text_timeout,
        ws_idle_timeout_s=args.ws_idle_timeout, ws_keepalive_timeout_s=args.ws_keepalive_timeout,
        ws_ahead_s=args.ws_ahead, ws_max_pending=args.ws_max_pending,
    )  # fmt: skip
    server.voice_aliases.update(args.voice_alias or {})
    governor = GovernorConfig(
        policy, memory_source=args.memory_source, interval_s=args.governor_interval,
        drain_deadline_s=args.drain_deadline, auto=not args.no_governor,
        allow_unevaluated=[v.strip() for v in (args.allow_unevaluated or "").split(",") if v.strip()],
        quality_budget=load_budget(Path(args.quality_budget)) if args.quality_budget else None,
        quality_min_items=args.quality_min_items, spare_worker=args.spare_worker,
    )  # fmt: skip
    return EngineConfig(
        model=args.model or str(default_tiny_checkpoint()),
        # An explicit ladder without --variant starts at its top; otherwise the model's default.
        variants=args.variant or ([policy.ladder[0]] if args.ladder_given else [None]),
        max_batch=args.max_batch, max_queue=args.max_queue,
        compute_dtype=compute_dtype_option(args.compute_dtype), server=server, governor=governor,
        frame_budget_s=args.frame_budget_ms, step_delay_s=args.fault_step_delay_ms / 1000,
        stream_memory=args.stream_memory_mb, loop_detector=not args.no_loop_detector,
    )  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    _need_mlx()
    from qwen3_tts_engine.config import build_server
    from qwen3_tts_engine.serving.app import InsecureServerError, serve_forever
    from qwen3_tts_engine.serving.auth import exposure_problem

    problem = exposure_problem(
        args.host, os.environ.get(API_KEY_ENV), os.environ.get(OPERATOR_KEY_ENV)
    )
    if problem and not args.insecure_no_auth:  # before a model loads
        print(f"qwen3-tts: error: {problem}", file=sys.stderr)
        return 2
    if args.fault_step_delay_ms and not args.allow_fault_injection:
        print("qwen3-tts: error: --fault-step-delay-ms is fault injection (drills, tests): "
              "pass --allow-fault-injection too", file=sys.stderr)  # fmt: skip
        return 2
    if not args.model:
        print(TINY_WARNING, file=sys.stderr)
    try:
        asyncio.run(serve_forever(build_server(engine_config(args))))
    except KeyboardInterrupt:
        pass
    except InsecureServerError as e:
        print(f"qwen3-tts: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        print(f"qwen3-tts: error: {args.host}:{args.port} is already in use (another engine?); "
              "stop it or pick another --port", file=sys.stderr)  # fmt: skip
        return 2
    return 0


# -- variant ----------------------------------------------------------------------------------


def cmd_variant(args: argparse.Namespace) -> int:
    """Show the governor's state, or swap the engine to a variant (pinned) / back to "auto"."""
    import httpx

    # the operator key where it is set (changing the variant may need it; it reads status too)
    headers = bearer_header(os.environ.get(OPERATOR_KEY_ENV) or os.environ.get(API_KEY_ENV))
    base = args.server.rstrip("/")
    timeout = httpx.Timeout(args.timeout, connect=10)
    if args.name is None:
        r = httpx.get(f"{base}/v1/engine/status", headers=headers, timeout=timeout)
    else:
        body = {"variant": args.name, "mode": args.mode, "pin": not args.no_pin}
        r = httpx.post(f"{base}/v1/engine/variant", json=body, headers=headers, timeout=timeout)
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text}}
    if r.status_code >= 400 and "error" in data:
        print(f"qwen3-tts: error: server answered {r.status_code}: {data['error']['message']}",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.name is None:  # the governor's state (or the whole status without a governor)
        status = EngineStatus.from_json(data)
        print(json.dumps(status.governor if status.governor is not None else data, indent=2))
        return 0 if r.status_code < 400 else 1
    change = VariantChange.from_json(data)
    if args.json:
        print(json.dumps(change.to_json(), indent=2))
    else:
        swap = change.swap
        done = (f"swapped {swap['from_variant']} -> {swap['to_variant']} ({swap['mode']}) in "
                f"{swap['latency_s']:.2f}s") if swap else "no swap needed"  # fmt: skip
        print(f"{done}; active variant {change.active_variant}, pinned: {change.pinned}")
    return 0 if r.status_code < 400 else 1


# -- say --------------------------------------------------------------------------------------


def _say_local(args: argparse.Namespace, req: SpeechRequest) -> tuple[dict, bytes]:
    """In-process synthesis (mlx on this main thread)."""
    _need_mlx()

    from qwen3_tts_engine.models.variants import resolve
    from qwen3_tts_engine.worker.loading import describe, load
    from qwen3_tts_engine.worker.synthesis import SynthesisStats, stream_chunks

    source = resolve(args.model or str(default_tiny_checkpoint()), args.variant)
    model, details = load(source, progress=True)
    if req.voice is None and (voices := describe(model)["voices"]):
        req.voice = voices[0]
    stats = SynthesisStats()
    pcm, chunks, first = [], [], None
    t0 = time.perf_counter()
    for chunk in stream_chunks(model, req, stats=stats):
        first = first if first is not None else time.perf_counter() - t0
        pcm.append(pcm16(chunk.audio))
        chunks.append({"frames": chunk.frames, "samples": int(chunk.audio.shape[0]),
                       "compute_s": round(chunk.compute_s, 4)})  # fmt: skip
    total = time.perf_counter() - t0
    return {"variant": source.variant, "load_s": round(details["load_s"], 3), "chunks": chunks,
            "first_audio_s": first, "total_s": total, "hit_token_cap": stats.hit_token_cap}, b"".join(pcm)  # fmt: skip


def _say_remote(args: argparse.Namespace, req: SpeechRequest) -> tuple[dict, bytes]:
    import httpx

    from qwen3_tts_engine.protocol import HEADER_VARIANT

    body = {k: v for k, v in req.to_dict().items() if v is not None}
    body.update(stream=True, response_format="pcm")
    headers = bearer_header(os.environ.get(API_KEY_ENV))
    pcm, chunks, first = [], [], None
    t0 = time.perf_counter()
    url = args.server.rstrip("/") + "/v1/audio/speech"
    with httpx.stream(
        "POST", url, json=body, headers=headers, timeout=httpx.Timeout(600, connect=10)
    ) as r:
        if r.status_code != 200:
            r.read()
            try:  # the error's message, as every command prints one
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise SystemExit(f"qwen3-tts: error: server answered {r.status_code}: {message}")
        variant = r.headers.get(HEADER_VARIANT)
        for data in r.iter_raw():
            first = first if first is not None else time.perf_counter() - t0
            pcm.append(data)
            chunks.append({"frames": len(data) // 2 / 1920, "samples": len(data) // 2})
    return {"variant": variant, "chunks": chunks, "first_audio_s": first,
            "total_s": time.perf_counter() - t0}, b"".join(pcm)  # fmt: skip


def cmd_say(args: argparse.Namespace) -> int:
    try:
        req = SpeechRequest(
            input=check_input(args.text), voice=args.voice, language=normalize_language(args.language),
            instructions=args.instructions, seed=args.seed, max_new_tokens=args.max_new_tokens,
            first_chunk_frames=args.first_chunk_frames, variant=args.variant if args.server else None,
        )  # fmt: skip
    except RequestError as e:
        print(f"qwen3-tts: error: {e.message}", file=sys.stderr)
        return 2
    if not args.model and not args.server:
        print(TINY_WARNING, file=sys.stderr)
    report, pcm = (_say_remote if args.server else _say_local)(args, req)
    audio_s = len(pcm) / 2 / SAMPLE_RATE
    report.update(sample_rate=SAMPLE_RATE, audio_s=audio_s,
                  rtf=report["total_s"] / audio_s if audio_s else None)  # fmt: skip
    if args.out:
        write_wav(Path(args.out), pcm)
        report["out"] = args.out
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{audio_s:.2f}s of audio in {len(report['chunks'])} chunks (variant "
              f"{report['variant']}), first audio after {report['first_audio_s']:.3f}s, "
              f"RTF {report['rtf']:.2f}" + (f" -> {args.out}" if args.out else ""))  # fmt: skip
    return 0


# -- demo / bench -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    _need_mlx()
    from qwen3_tts_engine.demo import run_demo

    return run_demo(args)


ENGINE_BENCH_VARIANTS = "bf16,8bit,6bit,4bit,talker-mlp-w4"


def _memory_bench(args: argparse.Namespace) -> int:
    """`bench memory`: a full batch's peak on the real-size architecture (bench/memory.py)."""
    import json

    from qwen3_tts_engine.bench.memory import BATCH_FRAMES, run_batch_memory_bench

    rungs = [v.strip() for v in (args.variants or "bf16").split(",") if v.strip()]
    report = run_batch_memory_bench(
        rungs, args.model, streams=args.max_batch, frames=args.frames or BATCH_FRAMES,
        compute_dtype=compute_dtype_option(args.compute_dtype),
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    _need_mlx()
    if args.what == "swap":
        from qwen3_tts_engine.bench.swap import run_swap_bench

        return run_swap_bench(args)
    if args.what == "formats":
        from qwen3_tts_engine.bench.formats import run_formats_bench

        return run_formats_bench(args)
    if args.what == "blas":
        from qwen3_tts_engine.bench.blas import run_blas_bench

        args.frames = args.frames or 8
        return run_blas_bench(args)
    if args.what == "concurrency":
        from qwen3_tts_engine.bench.concurrency import run_concurrency_bench

        args.frames = args.frames or 32
        return run_concurrency_bench(args)
    if args.what == "memory":
        return _memory_bench(args)
    if args.what == "first-chunk":
        from qwen3_tts_engine.bench.first_chunk import run_first_chunk_bench

        args.frames = args.frames or 48
        return run_first_chunk_bench(args)
    args.frames = args.frames or 8
    args.variants = args.variants or ENGINE_BENCH_VARIANTS
    if args.what == "spawn":
        from qwen3_tts_engine.bench.spawn import run_spawn_bench

        return run_spawn_bench(args)
    from qwen3_tts_engine.bench.engine import run_bench

    return run_bench(args)


class _VoiceAlias(argparse.Action):
    """--voice-alias NAME=VOICE, collected into a dict."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, sep, voice = values.partition("=")
        if not sep or not name.strip() or not voice.strip():
            parser.error(f"{option_string} takes NAME=VOICE, got {values!r}")
        aliases = dict(getattr(namespace, self.dest, None) or {})
        aliases[name.strip().lower()] = voice.strip().lower()
        setattr(namespace, self.dest, aliases)


class _Given(argparse.Action):
    """Stores the value and notes that it was given (defaults come from the Policy)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _add_governor_options(s: argparse.ArgumentParser) -> None:
    from qwen3_tts_engine.governor.policy import MODES, Policy

    d = Policy()
    g = s.add_argument_group("memory-pressure governor (docs/governor.md)")
    g.add_argument(
        "--ladder",
        default=",".join(d.ladder),
        action=_Given,
        help=f"variants from largest to smallest (default {','.join(d.ladder)}); "
        "without --variant the engine starts at the first",
    )
    g.set_defaults(ladder_given=False)
    g.add_argument(
        "--downgrade-at",
        type=float,
        default=d.downgrade_at,
        help=f"used fraction of the memory limit that moves down (default {d.downgrade_at})",
    )
    g.add_argument(
        "--upgrade-at",
        type=float,
        default=d.upgrade_at,
        help=f"used fraction below which it moves back up (default {d.upgrade_at})",
    )
    g.add_argument(
        "--downgrade-hold",
        type=float,
        default=d.downgrade_hold_s,
        metavar="S",
        help=f"seconds above --downgrade-at before moving (default {d.downgrade_hold_s})",
    )
    g.add_argument(
        "--upgrade-hold",
        type=float,
        default=d.upgrade_hold_s,
        metavar="S",
        help=f"seconds below --upgrade-at before moving (default {d.upgrade_hold_s})",
    )
    g.add_argument(
        "--cooldown",
        type=float,
        default=d.cooldown_s,
        metavar="S",
        help=f"seconds after a swap before the next (default {d.cooldown_s})",
    )
    g.add_argument(
        "--critical-at",
        type=float,
        default=d.critical_at,
        help=f"used fraction that moves down at once (default {d.critical_at})",
    )
    g.add_argument(
        "--swap-mode",
        choices=MODES,
        default=d.mode,
        help="auto: make-before-break when both workers fit (default)",
    )
    g.add_argument(
        "--drain-deadline",
        type=float,
        metavar="S",
        help="hard deadline for utterances on a swapped-out variant (default: none)",
    )
    g.add_argument(
        "--memory-source",
        default="auto",
        choices=["auto", "cgroup-v2", "cgroup-v1", "system", "macos"],
        help="where memory is read (auto: the container's cgroup limit, else the system's)",
    )
    g.add_argument(
        "--governor-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between memory readings (default 1.0)",
    )
    g.add_argument(
        "--allow-unevaluated",
        metavar="VARIANTS",
        help="operator consent: put these quantized rungs (comma-separated, or 'all') "
        "on the ladder without a stored passing `qwen3-tts eval` report",
    )
    g.add_argument(
        "--quality-budget",
        metavar="FILE",
        help="JSON/YAML budget a stored report must meet (default: eval's default budget)",
    )
    g.add_argument(
        "--quality-min-items",
        type=int,
        default=6,
        metavar="N",
        help="fewest evaluated items a stored report needs (default 6)",
    )
    g.add_argument(
        "--no-governor",
        action="store_true",
        help="no automatic swaps (POST /v1/engine/variant still works)",
    )
    g.add_argument(
        "--spare-worker",
        action="store_true",
        help="keep a worker process started for the next swap (modules imported, no "
        "model; ~90 MB): a swap under load then takes less CPU from the voices speaking",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _stream_memory(text: str) -> int | str | None:
    """--stream-memory-mb: megabytes (10^6) -> bytes; "auto"; "off" -> None."""
    value = text.strip().lower()
    if value in ("auto", "off"):
        return None if value == "off" else "auto"
    try:
        mb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"megabytes, 'auto' or 'off', got {text!r}") from None
    if mb <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return round(mb * 10**6)


def _frame_budget(text: str) -> float | None:
    try:
        return parse_budget_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _text_start_tokens(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_TEXT_START_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TEXT_START_TOKENS}, got {value}")
    return value


def _text_pace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not MIN_TEXT_PACE <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between {MIN_TEXT_PACE} and 1, got {value}")
    return value


def _client_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(_positive_int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not levels:
        raise argparse.ArgumentTypeError("name at least one concurrency level")
    return levels


class _DefaultsHelp(argparse.HelpFormatter):
    """Every option's help ends with its default, unless its help already names one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text.lower() and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` and every subcommand's parser under it format their help with `_DefaultsHelp`."""
    parser.formatter_class = _DefaultsHelp
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return _show_defaults(_build_parser())


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen3-tts", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny-checkpoint", help="write a tiny random checkpoint (tests, demos)")
    t.add_argument("out", help="folder to write the checkpoint to")
    # --kind: the checkpoint's model type (everywhere else --variant is a precision); the old
    # spelling still works
    t.add_argument(
        "--kind",
        "--variant",
        dest="variant",
        default="custom_voice",
        choices=["custom_voice", "base", "voice_design"],
        help="model type: CustomVoice (preset speakers), Base (cloning), VoiceDesign",
    )
    t.add_argument(
        "--bits",
        type=int,
        choices=[4, 6, 8],
        help="also quantize it to this many bits (default: not quantized)",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    t.add_argument(
        "--eos",
        choices=["text", "never", "random", "loop"],
        default="text",
        help="how utterances end: by EOS after about one frame per text token (text), "
        "only at --max-new-tokens (never), when sampling picks EOS (random), or never with a "
        "two-code cycle (loop: the loop detector's test model); "
        "in-context cloning (ref_audio + ref_text) ends at once with text",
    )
    t.set_defaults(fn=cmd_tiny_checkpoint)

    s = sub.add_parser("serve", help="run the engine server")
    s.add_argument("--model", help="hub id or local checkpoint (default: a tiny random one)")
    s.add_argument(
        "--variant",
        action="append",
        help="variant to load (repeat for several; "
        "the first serves by default): bf16, 8bit, 6bit, 4bit, talker-mlp-w4, ...",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"address to listen on; any but loopback needs {API_KEY_ENV} (or --insecure-no-auth)",
    )
    s.add_argument("--port", type=int, default=8880, help="port to listen on (0: any free one)")
    s.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help=f"listen on a non-loopback --host without {API_KEY_ENV}: anyone who can "
        "reach the port may synthesize and read the status (warned at every start)",
    )
    s.add_argument(
        "--ref-audio-dir",
        help="folder whose files ref_audio may name (default: none; ref_audio is then inline audio only)",
    )
    s.add_argument(
        "--max-queue", type=int, default=32, help="requests waiting for a slot before a 429"
    )
    s.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=256,
        metavar="N",
        help="WebSocket sessions open at once; more get 429 with Retry-After at the "
        "upgrade (default 256)",
    )
    s.add_argument(
        "--ws-first-text-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a WebSocket utterance's first text is due within S seconds of its start, "
        "or it ends with a 408 error event (default 30)",
    )
    s.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="while a session's text is open, its next message is due within S "
        "seconds, or it ends with a 408 error event (default 60)",
    )
    s.add_argument(
        "--ws-keepalive-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a WebSocket with no utterance in progress (before the first, between two) is "
        "closed (1000) once its client sent no message for S seconds (pings do not count; "
        "default 300)",
    )
    s.add_argument(
        "--ws-ahead",
        type=_positive_float,
        default=3.0,
        metavar="S",
        help="flow control: a socket's stream pauses (and lends its real-time slot) while more "
        "than S seconds of its audio wait unread by the client (default 3)",
    )
    s.add_argument(
        "--ws-max-pending",
        type=_positive_int,
        default=64,
        metavar="N",
        help="texts waiting their turn on one socket (the hosted protocol's server_commit "
        "responses, vLLM-Omni's sentences); past N a sentence end is not cut and a commit is a "
        "429 (default 64)",
    )
    s.add_argument(
        "--max-batch",
        type=_positive_int,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help="syntheses one worker runs together (continuous batching); more wait "
        f"in its queue (default {DEFAULT_MAX_BATCH})",
    )
    s.add_argument(
        "--frame-budget-ms",
        type=_frame_budget,
        default=os.environ.get(BUDGET_ENV, "80"),
        metavar="MS|off",
        help="admit a stream only while a batch step stays under this "
        "(a frame plays for 80 ms); fewer streams than --max-batch run where steps are "
        f"slower, the rest queue (docs/fleet.md). 'off': --max-batch streams. Default "
        f"${BUDGET_ENV} or 80",
    )
    s.add_argument(
        "--stream-memory-mb",
        type=_stream_memory,
        default="auto",
        metavar="MB|auto|off",
        help="admit a stream only while the memory of the streams running and its own (KV "
        "cache for its frame budget, vocoder state and transients: models/stream_memory.py) "
        "fits this many MB; the rest queue. auto (default): what the governor's downgrade "
        "watermark of the memory limit leaves the worker once loaded; off: no memory rule",
    )
    s.add_argument(
        "--no-loop-detector",
        action="store_true",
        help="let a looping sentence run to its frame cap (finish reason length) instead of "
        "ending it as repetition once its codebook-0 codes cycle or stall for 48 frames "
        "(docs/engine-api.md, Loop detector)",
    )
    s.add_argument(
        "--fault-step-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="fault injection: every batch step sleeps MS per stream in it, as on a "
        "slower host (drills and tests of the real-time admission; needs "
        "--allow-fault-injection)",
    )
    s.add_argument(
        "--allow-fault-injection",
        action="store_true",
        help="serve POST /v1/engine/fault (operator key when one is set) and allow "
        "--fault-step-delay-ms: drills and tests, never production (without it: 404)",
    )
    s.add_argument(
        "--compute-dtype",
        choices=COMPUTE_CHOICES,
        default="auto",
        help="what the talker computes in (default auto: float32 on mlx's CPU backend, "
        "where its matmuls run on BLAS (the real 0.6B talker's step 1.6x faster "
        "alone and 4x at 8 streams than in bfloat16) at twice the memory of "
        "bfloat16 weights for the talker; its weights' own dtype on a Mac or GPU. "
        "weights: always the weights' dtype)",
    )
    s.add_argument(
        "--max-input-chars",
        type=int,
        default=4000,
        help="longest input text, in characters (longer: a 400)",
    )
    # a string default goes through `type`: a bad environment value is refused like a bad flag
    s.add_argument(
        "--text-start-tokens",
        type=_text_start_tokens,
        metavar="N",
        default=os.environ.get(TEXT_START_TOKENS_ENV, str(DEFAULT_TEXT_START_TOKENS)),
        help="streamed text: text tokens committed before the first frame, 1-"
        f"{MAX_TEXT_START_TOKENS} (default ${TEXT_START_TOKENS_ENV} or "
        f"{DEFAULT_TEXT_START_TOKENS}; docs/engine-api.md)",
    )
    s.add_argument(
        "--text-pace",
        type=_text_pace,
        metavar="P",
        default=os.environ.get(TEXT_PACE_ENV, str(DEFAULT_TEXT_PACE)),
        help=f"dual-track: text tokens fed per frame at most, {MIN_TEXT_PACE}-1 (default "
        f"${TEXT_PACE_ENV} or {DEFAULT_TEXT_PACE}: the reference code's one per frame)",
    )
    s.add_argument(
        "--voice-alias",
        action=_VoiceAlias,
        metavar="NAME=VOICE",
        help="a voice name requests may use for one of the model's voices (repeatable; "
        "OpenAI's names are mapped by default, e.g. alloy=vivian, echo=aiden)",
    )
    _add_governor_options(s)
    s.set_defaults(fn=cmd_serve)

    v = sub.add_parser("variant", help="show the memory governor, or swap the served variant")
    v.add_argument(
        "name",
        nargs="?",
        metavar="VARIANT",
        help='variant to swap to (pinned), or "auto" to let the governor decide; '
        "omit to print the governor's status",
    )
    v.add_argument("--server", required=True, help="engine URL, e.g. http://127.0.0.1:8880")
    v.add_argument(
        "--mode",
        choices=["auto", "make-before-break", "break-before-make"],
        default="auto",
        help="swap mode (auto: make-before-break when both workers fit)",
    )
    v.add_argument("--no-pin", action="store_true", help="let the governor move away from it again")
    v.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the swap")
    v.add_argument("--json", action="store_true", help="print the change as JSON")
    v.set_defaults(fn=cmd_variant)

    y = sub.add_parser("say", help="synthesize one text in-process or through a server")
    y.add_argument("text", help="the text to speak")
    y.add_argument("--model", help="hub id or local checkpoint (default: a tiny random one)")
    y.add_argument(
        "--variant",
        help="precision to load or ask for: bf16, 8bit, 6bit, 4bit, ... (default: the model's)",
    )
    y.add_argument("--voice", help="speaker (default: the model's first)")
    y.add_argument(
        "--language", default="auto", help="language name, e.g. english (auto: detected)"
    )
    y.add_argument("--instructions", help="style instruction (VoiceDesign and 1.7B models)")
    y.add_argument("--seed", type=int, help="sampling seed (default: random)")
    y.add_argument("--max-new-tokens", type=int, help="frame cap (default: from the text)")
    y.add_argument(
        "--first-chunk-frames",
        type=int,
        choices=[1, 2, 4],
        default=4,
        help="frames in the first audio chunk",
    )
    y.add_argument("--server", help="engine URL, e.g. http://127.0.0.1:8880")
    y.add_argument("--out", help="write a WAV file")
    y.add_argument("--json", action="store_true", help="print a JSON report")
    y.set_defaults(fn=cmd_say)

    d = sub.add_parser("demo", help="offline engine demo: server + streamed synthesis to a WAV")
    d.add_argument("--model", help="hub id or local checkpoint (default: a tiny random one)")
    d.add_argument(
        "--text",
        default="Hello! This is the Qwen3 TTS engine, streaming in chunks.",
        help="the text to speak",
    )
    d.add_argument("--out", default="out/demo.wav", help="WAV file to write")
    d.add_argument(
        "--max-new-tokens",
        type=int,
        help="frame cap (default: from the text; 25 for the tiny random checkpoint)",
    )
    d.add_argument("--json", action="store_true", help="print a JSON report")
    d.set_defaults(fn=cmd_demo)

    from qwen3_tts_engine.quant.cli import add_parsers

    add_parsers(sub)

    b = sub.add_parser(
        "bench",
        help="benchmarks (JSON): engine (default), swap, spawn, formats, "
        "concurrency, blas, first-chunk or memory",
    )
    b.add_argument(
        "what",
        nargs="?",
        choices=[
            "engine",
            "swap",
            "spawn",
            "formats",
            "concurrency",
            "blas",
            "first-chunk",
            "memory",
        ],
        default="engine",
        help="engine: per-variant latency and memory; swap: governor swap latency, "
        "audio gap and memory in both swap modes; spawn: a worker's start-up cost "
        "besides loading weights; formats: first byte and encode cost per response "
        "format, as ratios to pcm; concurrency: many streams on one model "
        "(continuous batching): first audio, real-time factor and frames/s per level; blas: "
        "first audio of `serve` started from a clean environment vs with OpenBLAS "
        "preloaded, and the BLAS each worker runs; first-chunk: first audio and seams "
        "with a 1-, 2- and 4-frame first chunk, sentence and streamed text; memory: the "
        "peak RSS and mlx memory of --max-batch streams speaking 4-frame chunks together on "
        "the real 0.6B architecture (random weights), per stream and at the frame cap",
    )
    b.add_argument(
        "--variants",
        default=None,
        help=f"engine: default {ENGINE_BENCH_VARIANTS}; memory: default bf16",
    )
    b.add_argument("--model", help="checkpoint (default: a tiny random one)")
    b.add_argument("--repeats", type=int, default=5, help="runs per measurement")
    b.add_argument(
        "--frames",
        type=_positive_int,
        default=None,
        help="frames per request (engine: default 8, first audio and one more chunk; "
        "concurrency: default 32; first-chunk: the cap per sentence, default 48; memory: "
        "per stream, whole 4-frame chunks, default 8)",
    )
    b.add_argument(
        "--streams",
        type=_client_levels,
        default=(1, 2, 4, 8),
        help="concurrency: levels, comma-separated (default 1,2,4,8)",
    )
    b.add_argument(
        "--compute-dtype",
        choices=COMPUTE_CHOICES,
        default="auto",
        help="concurrency, memory: what the talker computes in (as `serve`; default auto)",
    )
    b.add_argument(
        "--real-size",
        action="store_true",
        help="concurrency: the real 0.6B architecture with random weights (written "
        "to the cache once, ~2.5 GB) instead of --model",
    )
    b.add_argument(
        "--codes-only",
        action="store_true",
        help="concurrency: the codes paths only (no vocoder, no server; for a "
        "real-size model on a CPU, whose vocoder takes seconds per chunk)",
    )
    b.add_argument(
        "--no-http", action="store_true", help="concurrency: in-process paths only (no server)"
    )
    b.add_argument(
        "--clients",
        type=_client_levels,
        default=(1, 2, 4),
        help="engine: concurrency levels, comma-separated (default 1,2,4)",
    )
    b.add_argument(
        "--plain-loads",
        type=_positive_int,
        default=2,
        help="swap: plain loads per variant whose median is the reference (default 2)",
    )
    b.add_argument(
        "--real-size-memory",
        action="store_true",
        help="also build the real 0.6B architecture (random weights) per variant",
    )
    b.add_argument(
        "--tokens-per-s",
        type=float,
        default=40.0,
        help="first-chunk: how fast the simulated LLM writes ~3-character pieces (default 40)",
    )
    b.add_argument(
        "--max-batch",
        type=_positive_int,
        default=DEFAULT_MAX_BATCH,
        help=f"memory: streams speaking together, as `serve --max-batch` (default {DEFAULT_MAX_BATCH})",
    )
    b.add_argument("--out", help="also write the JSON here")
    b.set_defaults(fn=cmd_bench)
    return p


# Commands that run no mlx in this process (`say --server` neither, but loading OpenBLAS costs
# it nothing it would notice).
SERVER_SIDE_COMMANDS = ("serve", "variant")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("QWEN3_TTS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    args = build_parser().parse_args(argv)
    if args.command not in SERVER_SIDE_COMMANDS:
        use_fast_blas()  # before a command imports mlx (fast_blas.py); serve's workers load it themselves
        import_mlx_lm()  # keeps the open-file limit (open_files.py)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"qwen3-tts: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
