"""The LiveKit worker: `voice-agent start | dev | console` through LiveKit's own agent CLI.

The main process makes sure a TTS engine and an LLM are reachable (starting local ones when no URL
is set) and passes their URLs to the job processes through the environment; each job process
loads Silero and faster-whisper once (prewarm) and serves its rooms with them.
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

from livekit.agents import AgentServer, JobContext, JobProcess, cli

from .local_services import ensure_llm, ensure_tts_engine, resolve_offline
from .observability import TurnMetrics
from .pipeline import VoiceAgent, build_session, build_stt
from .settings import Settings


def prewarm(proc: JobProcess) -> None:
    from livekit.plugins import openai, silero  # noqa: F401  (importing openai later blocks a job's loop ~1 s)

    settings = Settings.load()
    proc.userdata["vad"] = silero.VAD.load()
    stt = build_stt(settings)
    stt.load()  # the model is loaded once per process and shared by its jobs
    proc.userdata["stt"] = stt


server = AgentServer(setup_fnc=prewarm)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    settings = Settings.load()
    session = build_session(settings, tts_url=os.environ["TTS_URL"], llm_url=os.environ["LLM_BASE_URL"],
                            vad=ctx.proc.userdata["vad"], stt=ctx.proc.userdata["stt"])  # fmt: skip
    TurnMetrics(session)  # one log line per turn, with LiveKit's per-turn latencies
    await session.start(agent=VoiceAgent(settings.instructions), room=ctx.room)


def _check_livekit_url() -> str | None:
    url = os.environ.get("LIVEKIT_URL")
    if not url:
        return "LIVEKIT_URL is not set (and LIVEKIT_API_KEY / LIVEKIT_API_SECRET): see the README"
    u = urlparse(url)
    port = u.port or (443 if u.scheme in ("wss", "https") else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=3).close()
    except OSError as e:
        return f"cannot reach the LiveKit server at {url}: {e}"
    return None


def _check_audio_devices() -> str | None:
    try:
        import sounddevice

        sounddevice.query_devices(kind="input")
    except (OSError, ImportError) as e:
        return (f"no audio device for console mode ({e}); on Debian install libportaudio2, "
                "on a Mac check the microphone permission")  # fmt: skip
    except Exception as e:  # sounddevice.PortAudioError: no default input device
        return f"no microphone found for console mode: {e}"
    return None


def run_worker(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if "--help" in argv or "-h" in argv:
        sys.argv = ["voice-agent", *argv]
        cli.run_app(server)
        return 0
    problem = (_check_audio_devices() if command == "console"
               else _check_livekit_url() if command in ("start", "dev", "connect") else None)  # fmt: skip
    if problem:
        print(f"voice-agent: {problem}", file=sys.stderr)
        return 1
    settings = resolve_offline(Settings.load())
    if settings.offline:
        os.environ["VOICE_AGENT_OFFLINE"] = "1"  # job processes pick the bundled STT model too
    tts = ensure_tts_engine(settings)
    llm = ensure_llm(settings)
    for service in (tts, llm):
        for note in service.notes:
            print(f"NOTE: {note}", file=sys.stderr)
    os.environ["TTS_URL"], os.environ["LLM_BASE_URL"] = tts.url, llm.url
    if llm.model:
        os.environ["LLM_MODEL"] = llm.model
    sys.argv = ["voice-agent", *argv]
    try:
        cli.run_app(server)
    finally:
        tts.stop()
        llm.stop()
    return 0
