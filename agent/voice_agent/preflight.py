"""Checks a LiveKit command can pass before anything heavy is imported or started: the LiveKit
server's URL (set, well formed, reachable) for start/dev/connect, an input device for console.
`voice-agent` runs them before it imports livekit.agents (seconds of CPU), so a wrong URL is one
line at once."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from urllib.parse import urlparse


def preflight_problem(argv: Sequence[str]) -> str | None:
    """What stops LiveKit's command `argv[0]` from running here, in one line; None: nothing."""
    command = argv[0] if argv else ""
    if command == "console":
        return _check_audio_devices()
    if command in ("start", "dev", "connect"):
        return _check_livekit_url(argv)
    return None


def _url_option(argv: Sequence[str]) -> str | None:
    """The value of LiveKit's `--url` option in `argv` (it wins over LIVEKIT_URL), if given."""
    for i, arg in enumerate(argv):
        if arg == "--url" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--url="):
            return arg.split("=", 1)[1]
    return None


def _check_livekit_url(argv: Sequence[str] = ()) -> str | None:
    url = _url_option(argv) or os.environ.get("LIVEKIT_URL")
    if not url:
        return (
            "LIVEKIT_URL is not set (and LIVEKIT_API_KEY / LIVEKIT_API_SECRET): see docs/agent.md"
        )
    u = urlparse(url)
    try:
        port = u.port or (443 if u.scheme in ("wss", "https") else 80)
    except ValueError as e:  # a port out of range or not a number
        return f"LIVEKIT_URL {url!r} is not a valid URL: {e}"
    if u.scheme not in ("ws", "wss", "http", "https") or not u.hostname:
        return f"LIVEKIT_URL {url!r} is not a ws://, wss://, http:// or https:// URL"
    try:
        socket.create_connection((u.hostname, port), timeout=3).close()
    except OSError as e:
        return f"cannot reach the LiveKit server at {url}: {e}"
    return None


def _check_audio_devices() -> str | None:
    try:
        import sounddevice  # optional: it needs the PortAudio library, and only console mode does

        sounddevice.query_devices(kind="input")
    except (OSError, ImportError) as e:
        return (f"no audio device for console mode ({e}); on Debian install libportaudio2, "
                "on a Mac check the microphone permission")  # fmt: skip
    except Exception as e:  # sounddevice.PortAudioError: no default input device
        return f"no microphone found for console mode: {e}"
    return None
