"""`voice-agent`: start | dev | console (LiveKit worker, or the local agent), demo, web, keeper, settings.

`start`/`dev`/`console` hand over to LiveKit's own agent CLI with our worker; `demo` runs spoken
turns from WAV files through the whole pipeline without a LiveKit server; `web` serves the browser
client and its token endpoint.

Each command imports what it runs when it runs (the worker, the harness, the lab): this module
imports only the settings, so `--help`, `settings` and a mistyped flag answer at once instead of
after LiveKit's few seconds of imports.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading
from dataclasses import fields
from pathlib import Path

from voice_agent.metrics_dir import use_multiprocess_dir
from voice_agent.preflight import preflight_problem
from voice_agent.settings import (
    KeeperSettings,
    Settings,
    WebSettings,
    add_arguments,
    from_args,
    markdown_table,
)

# LiveKit's own options of the commands its CLI runs, name -> (takes a value, help). Our parser
# knows them so that `--help` is quick and lists the settings too, and a mistyped flag fails
# before anything starts; tests/system/test_agent_cli_livekit.py keeps this equal to livekit-agents' CLI.
_LOG_LEVEL = ("log-level", True, "LiveKit's log level (DEBUG, INFO, WARN, ERROR, CRITICAL)")
_SERVER = (("url", True, "the LiveKit server's WebSocket URL [LIVEKIT_URL]"),
           ("api-key", True, "[LIVEKIT_API_KEY]"), ("api-secret", True, "[LIVEKIT_API_SECRET]"))  # fmt: skip
LIVEKIT_OPTIONS: dict[str, tuple[tuple[str, bool, str], ...]] = {
    "start": (_LOG_LEVEL, *_SERVER,
              ("drain-timeout", True, "seconds to wait for jobs to finish when stopping"),
              ("simulation", False, "(set by `lk simulate`)")),
    "dev": (_LOG_LEVEL, ("reload", False, "restart the worker when the code changes"), *_SERVER),
    "console": (("input-device", True, "input device ID or name substring"),
                ("output-device", True, "output device ID or name substring"),
                ("list-devices", False, "list the audio devices and exit"),
                ("text", False, "text mode"), ("record", False, "record the session"), _LOG_LEVEL),
    "connect": (_LOG_LEVEL, *_SERVER, ("room", True, "the room to join"),
                ("participant-identity", True, "the agent's identity in the room")),
    "download-files": (),
}  # fmt: skip
LIVEKIT_COMMANDS = tuple(LIVEKIT_OPTIONS)
_HELP = {
    "start": "run the LiveKit worker (production)", "dev": "the worker in development mode",
    "console": "the agent on this machine's microphone and speaker",
    "connect": "join one room directly", "download-files": "fetch the plugins' model files",
}  # fmt: skip


def _add_livekit_command(sub, name: str) -> None:
    s = sub.add_parser(name, help=f"{_HELP[name]} (LiveKit's `{name}`)",
                       description=f"LiveKit's `{name}` with this project's worker and settings.")  # fmt: skip
    add_arguments(s)
    lk = s.add_argument_group("LiveKit's options")
    for option, takes_value, help in LIVEKIT_OPTIONS[name]:
        dest = "lk_" + option.replace("-", "_")
        if takes_value:
            lk.add_argument(
                f"--{option}", dest=dest, help=help, metavar=option.split("-")[-1].upper()
            )
        else:
            lk.add_argument(f"--{option}", dest=dest, action=argparse.BooleanOptionalAction,
                            help=help)  # fmt: skip


def livekit_argv(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """What LiveKit's CLI gets (the command and its own options as given), and the settings
    given as flags as environment variables (the worker and its job processes read those)."""
    argv = [args.command]
    for option, takes_value, _ in LIVEKIT_OPTIONS[args.command]:
        value = getattr(args, "lk_" + option.replace("-", "_"))
        if value is None:
            continue
        argv += [f"--{option}", value] if takes_value else [f"--{'' if value else 'no-'}{option}"]
    env = {}
    for f in fields(Settings):
        value = getattr(args, f.name, None)
        if value is not None:
            env[f.metadata["env"]] = (
                ("1" if value else "0") if isinstance(value, bool) else str(value)
            )
    return argv, env


def _numbers(text: str) -> tuple[float, ...]:
    """An option's comma-separated numbers (`--loads 0.5,1.2`); argparse's error otherwise."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers, not {text!r}") from None


class _DefaultsHelp(argparse.HelpFormatter):
    """Every option's help ends with its default, unless its help already names one (the
    settings' flags name theirs: settings.add_arguments)."""

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
    p = argparse.ArgumentParser(prog="voice-agent", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in LIVEKIT_COMMANDS:
        _add_livekit_command(sub, name)
    d = sub.add_parser("demo", help="spoken turns from WAV files through the pipeline, offline")
    d.add_argument(
        "wav", nargs="*", type=Path, help="user turns (default: a question by espeak-ng)"
    )
    d.add_argument(
        "--out", type=Path, default=Path("out/agent-reply.wav"), help="WAV file of the replies"
    )
    d.add_argument("--json", action="store_true", help="machine-readable report")
    add_arguments(d)
    b = sub.add_parser(
        "bench",
        help="how soon the agent answers (tuned vs baseline settings); "
        "TTS under LLM contention; `bench soak`: calls under injected faults (JSON)",
    )
    b.add_argument(
        "suite",
        nargs="?",
        choices=["soak", "fleet", "link", "call"],
        help="soak: callers keep calling a "
        "real livekit-server (two workers, one engine) while faults are injected; fleet: "
        "the TTS plugin's priority vs balanced strategy over engines pinned to cores; link: "
        "first audio on a fresh vs a warm socket across an emulated link (root); call: "
        "voice-to-voice where a caller on a real livekit-server hears it",
    )
    b.add_argument("--turns", type=int, default=6, help="plain spoken questions per configuration")
    b.add_argument(
        "--paused-turns",
        type=int,
        default=5,
        help="questions with a pause in the middle per configuration",
    )
    b.add_argument("--tts-requests", type=int, default=8, help="TTS requests per contention level")
    b.add_argument("--out", type=Path, help="also write the JSON report here")
    b.add_argument("--json", action="store_true", help="JSON on stdout (bench always prints it)")
    b.add_argument("--llm-pace", type=float, metavar="TOKENS_PER_S",
                   help="the LLM is a paced stand-in: a fixed reply at this rate, no CPU")  # fmt: skip
    b.add_argument("--llm-first-token-ms", type=float, default=150.0,
                   help="the paced stand-in's first-token delay (with --llm-pace)")  # fmt: skip
    soak = b.add_argument_group("soak (`voice-agent bench soak`)")
    soak.add_argument("--minutes", type=float, default=20.0, help="how long the callers call")
    soak.add_argument("--callers", type=int, default=2, help="callers calling at the same time")
    soak.add_argument(
        "--faults",
        default="all",
        help="all, none, or a comma-separated list of "
        "governor_swap, engine_worker_kill, llm_outage, agent_worker_kill, livekit_restart",
    )
    soak.add_argument(
        "--short", action="store_true", help="the short version: 2.5 minutes, each fault once"
    )
    soak.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs) after the run"
    )
    soak.add_argument(
        "--logs", type=Path, help="copy the processes' logs into this folder at the end"
    )
    fleet = b.add_argument_group("fleet (`voice-agent bench fleet`)")
    fleet.add_argument("--engines", type=int, default=2, help="engines, one per CPU core")
    fleet.add_argument("--streams", type=int, default=24, help="streams per phase")
    fleet.add_argument("--gap", type=float, default=0.25, help="seconds between arrivals")
    fleet.add_argument("--engine-max-batch", type=int, default=8, help="each engine's --max-batch")
    fleet.add_argument("--frames", type=int, default=24, help="max frames per utterance")
    fleet.add_argument("--engine-model", help="checkpoint (default: the tiny random one)")
    fleet.add_argument(
        "--runs", type=int, default=3, help="runs per configuration, each on a fresh fleet"
    )
    fleet.add_argument("--paths", default="sentences,stream",
                       help="configurations: sentences (HTTP), stream (the default text_input)")  # fmt: skip
    fleet.add_argument("--loads", default="", type=_numbers,
                       help="a sweep: offered loads as multiples of one engine's slots, e.g. "
                       "0.5,1.2,1.5,1.8 (sets each phase's gap; no churn phase)")  # fmt: skip
    link = b.add_argument_group("link (`voice-agent bench link`; --engine-model too)")
    link.add_argument("--rtt-ms", default="20,50", type=_numbers,
                      help="round-trip times of the delay line")  # fmt: skip
    link.add_argument("--utterances", type=int, default=10, help="per RTT and socket kind")
    add_arguments(b)
    w = sub.add_parser("web", help="the browser client and its LiveKit token endpoint")
    add_arguments(w, WebSettings)
    k = sub.add_parser(
        "keeper",
        help="calls get their agent back: LiveKit webhooks and job heartbeats, explicit dispatch",
    )
    add_arguments(k, KeeperSettings)
    sub.add_parser("settings", help="print the settings table (Markdown)")
    return p


def main(argv: list[str] | None = None) -> int:
    """`voice-agent`; Ctrl-C ends it with one line (what it started is stopped on the way out).

    Run as the program (no `argv`), it ends without finalizing the interpreter where LiveKit's
    native library was loaded: see `_exit_past_livekit`."""
    try:
        code = _main(argv)
    except KeyboardInterrupt:
        print("voice-agent: interrupted", file=sys.stderr)
        code = 130
    except SystemExit as e:  # argparse, a bad setting: as the interpreter would end it
        if argv is not None or "livekit.rtc" not in sys.modules:
            raise
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if argv is None and "livekit.rtc" in sys.modules:
        _exit_past_livekit(code)
    return code


def _exit_past_livekit(code: int) -> None:
    """End the process once our services have stopped, with LiveKit's FFI closed, and without
    finalizing the interpreter. LiveKit's native threads (tokio) call into Python (its log
    callback); one that does while the interpreter finalizes is killed by CPython 3.11 with
    pthread_exit, whose forced unwind through Rust aborts the process ("panic in a function that
    cannot unwind", exit 134) after our last line was printed. So: what finalization would do
    first (join non-daemon threads, the atexit handlers: LiveKit's `livekit_ffi_dispose` among
    them, logging's flush), then flush and `os._exit`: no native thread can meet a half-torn-down
    interpreter."""
    shutdown = getattr(threading, "_shutdown", None)
    try:
        if shutdown is not None:
            shutdown()  # the non-daemon threads, as Py_FinalizeEx waits for them
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("VOICE_AGENT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    args = build_parser().parse_args(argv)
    if args.command in LIVEKIT_COMMANDS:
        lk_argv, env = livekit_argv(args)
        os.environ.update(env)
        settings = Settings.load()  # a bad setting fails first, in one line (SystemExit)
        if problem := preflight_problem(lk_argv):  # before livekit.agents' seconds of imports
            print(f"voice-agent: error: {problem}", file=sys.stderr)
            return 1
        if args.command in ("start", "dev") and settings.metrics_port:
            use_multiprocess_dir()  # before livekit.agents imports prometheus_client
        # CLI start-up time (livekit.agents takes seconds), and after use_multiprocess_dir
        from voice_agent.worker import run_worker

        return run_worker(lk_argv, settings)
    if args.command == "settings":
        print(markdown_table())
        return 0
    if args.command == "web":
        from voice_agent.web_client import run_web  # CLI start-up time: only `web` needs it

        return run_web(from_args(args, WebSettings))
    if args.command == "keeper":
        from voice_agent.keeper import run_keeper  # CLI start-up time: only `keeper` needs it

        return run_keeper(from_args(args, KeeperSettings))
    if args.command == "bench" and args.suite == "soak":
        from voice_agent.lab.soak.run import parse_faults, run_soak  # CLI start-up time: the lab

        try:
            faults = parse_faults(args.faults)
        except ValueError as e:
            print(f"voice-agent: error: {e}", file=sys.stderr)
            return 2
        minutes = 2.5 if args.short else args.minutes
        if minutes <= 0 or args.callers < 1:
            print("voice-agent: error: --minutes must be > 0 and --callers >= 1", file=sys.stderr)
            return 2
        try:
            return run_soak(minutes, args.callers, faults, args.out, keep=args.keep, logs=args.logs)
        except (RuntimeError, TimeoutError, FileNotFoundError) as e:
            print(f"voice-agent: error: {e}", file=sys.stderr)
            return 1
    if args.command == "bench" and args.suite == "fleet":
        from voice_agent.lab.fleet_bench import run_fleet_bench  # CLI start-up time: the lab

        return run_fleet_bench(args.engine_model, args.engines, args.streams, args.gap,
                               args.engine_max_batch, args.frames, args.out, args.runs,
                               tuple(p.strip() for p in args.paths.split(",") if p.strip()),
                               args.loads)  # fmt: skip
    if args.command == "bench" and args.suite == "call":
        from voice_agent.lab.call_bench import run_call_bench  # CLI start-up time: the lab

        return run_call_bench(args.turns, args.runs, args.llm_pace or 30.0,
                              args.llm_first_token_ms / 1000, args.engine_model, args.out)  # fmt: skip
    if args.command == "bench" and args.suite == "link":
        from voice_agent.lab.link_bench import run_link_bench  # CLI start-up time: the lab

        return run_link_bench(args.engine_model, list(args.rtt_ms), args.utterances, args.out)
    # CLI start-up time: the harness (LiveKit's pipeline) and the services, for demo and bench only
    from voice_agent.harness.demo import TurnAudioError, run_demo
    from voice_agent.services import resolve_offline

    settings = resolve_offline(from_args(args))

    try:
        if args.command == "bench":
            # CLI start-up time: the lab, for bench only
            from voice_agent.lab.bench import run_bench

            if args.llm_pace is not None and args.llm_pace <= 0:
                print("voice-agent: error: --llm-pace must be > 0", file=sys.stderr)
                return 2
            pace = (args.llm_pace, args.llm_first_token_ms / 1000) if args.llm_pace else None
            return run_bench(settings, args.turns, args.paused_turns, args.tts_requests, args.out,
                             pace)  # fmt: skip
        return run_demo(settings, args.wav, args.out, args.json)
    except (RuntimeError, TimeoutError, FileNotFoundError, TurnAudioError) as e:
        print(f"voice-agent: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
