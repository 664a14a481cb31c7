"""`voice-agent`: start | dev | console (LiveKit worker, or the local agent), demo, web, settings.

`start`/`dev`/`console` hand over to LiveKit's own agent CLI with our worker; `demo` runs spoken
turns from WAV files through the whole pipeline without a LiveKit server; `web` serves the browser
client and its token endpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .settings import WebSettings, add_arguments, from_args, markdown_table

LIVEKIT_COMMANDS = ("start", "dev", "console", "connect", "download-files")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voice-agent", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in LIVEKIT_COMMANDS:
        sub.add_parser(name, help=f"LiveKit's `{name}` (see `voice-agent {name} --help`)",
                       add_help=False)  # fmt: skip
    d = sub.add_parser("demo", help="spoken turns from WAV files through the pipeline, offline")
    d.add_argument("wav", nargs="*", type=Path, help="user turns (default: a question by espeak-ng)")
    d.add_argument("--out", type=Path, default=Path("out/agent-reply.wav"))
    d.add_argument("--json", action="store_true", help="machine-readable report")
    add_arguments(d)
    b = sub.add_parser("bench", help="latency the pipeline adds; TTS under LLM contention (JSON)")
    b.add_argument("--turns", type=int, default=10)
    b.add_argument("--tts-requests", type=int, default=8)
    b.add_argument("--out", type=Path)
    add_arguments(b)
    w = sub.add_parser("web", help="the browser client and its LiveKit token endpoint")
    add_arguments(w, WebSettings)
    sub.add_parser("settings", help="print the settings table (Markdown)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("VOICE_AGENT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if argv and argv[0] in LIVEKIT_COMMANDS:
        from .worker import run_worker

        return run_worker(argv)
    args = build_parser().parse_args(argv)
    if args.command == "settings":
        print(markdown_table())
        return 0
    if args.command == "web":
        from .web_client import run_web

        return run_web(from_args(args, WebSettings))
    from .demo import TurnAudioError, run_demo
    from .local_services import resolve_offline

    settings = resolve_offline(from_args(args))

    try:
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(settings, args.turns, args.tts_requests, args.out)
        return run_demo(settings, args.wav, args.out, args.json)
    except (RuntimeError, TimeoutError, FileNotFoundError, TurnAudioError) as e:
        print(f"voice-agent: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
