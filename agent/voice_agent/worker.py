"""The LiveKit worker: `voice-agent start | dev | console` through LiveKit's own agent CLI.

The main process makes sure a TTS engine and an LLM are reachable (starting local ones when no URL
is set) and passes their URLs to the job processes through the environment; each job process
loads Silero and faster-whisper once (prewarm) and serves its rooms with them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

from livekit.agents import AgentServer, JobContext, JobProcess, cli
from livekit.agents.beta.tools import EndCallTool
from livekit.agents.telemetry import set_tracer_provider
from livekit.agents.voice.room_io import AudioOutputOptions, RoomOptions
from livekit.agents.worker import _DefaultLoadCalc

from voice_agent.fleet_load import FleetPoller
from voice_agent.observability import TurnMetrics, tracer_provider_from_env
from voice_agent.pipeline import VoiceAgent, build_session, build_stt, build_vad
from voice_agent.recovery import (
    CallRecord,
    accept_job,
    chat_context,
    is_resume_dispatch,
    keep_one_agent,
)
from voice_agent.services import LocalService, ensure_llm, ensure_tts_engine, resolve_offline
from voice_agent.settings import Settings, parse_dtmf_actions
from voice_agent.telephony import PHONE_SAMPLE_RATE, PhoneCall, PhoneCaller

logger = logging.getLogger("voice_agent")

_poller: FleetPoller | None = None
_count_cpu = True
_poller_lock = threading.Lock()


def watch_fleet(settings: Settings, tts_url: str) -> FleetPoller | None:
    """Start (or replace) the poller `load` reads: every engine behind `tts_url` (a comma-separated
    list, as TTS_URL), weighed with `settings` (`tts_queue_capacity`, `agent_load_cpu`)."""
    global _poller, _count_cpu
    urls = [u.strip() for u in tts_url.split(",") if u.strip()]
    with _poller_lock:
        if _poller is not None:
            _poller.stop()
        _count_cpu = settings.agent_load_cpu
        _poller = (
            FleetPoller(urls, queue_capacity=settings.tts_queue_capacity).start() if urls else None
        )
        return _poller


def load(server: AgentServer) -> float:
    """AgentServer.load_fnc (called from an executor thread every 0.5 s): the busier of this
    host's CPU and the TTS fleet it uses (voice_agent.fleet_load: every engine behind TTS_URL,
    as `watch_fleet` was given it)."""
    with _poller_lock:
        poller, count_cpu = _poller, _count_cpu
    cpu = _DefaultLoadCalc.get_load(server) if count_cpu else 0.0
    if poller is None:
        return cpu
    return min(1.0, max(cpu, poller.load()))


def prewarm(proc: JobProcess) -> None:
    # In the job process, before its first call (imported later, openai blocks a job's loop ~1 s);
    # not at the top: the worker's main process never builds a pipeline (CLI start-up time)
    from livekit.plugins import openai, silero  # noqa: F401

    settings = Settings.load()
    proc.userdata["vad"] = build_vad(settings)
    proc.userdata["phone_vad"] = build_vad(settings, phone=True)  # for callers of kind SIP
    stt = build_stt(settings)
    stt.load()  # the model is loaded once per process and shared by its jobs
    proc.userdata["stt"] = stt
    # traces of each turn (LiveKit's spans: user turn, STT, LLM, TTS, our engine requests)
    provider = tracer_provider_from_env()
    if provider is not None:
        set_tracer_provider(provider)
    proc.userdata["tracer_provider"] = provider


# prewarm loads Silero and faster-whisper: LiveKit's 10 s limit kills it on a busy host (seen at a
# load average of 10 on 2 cores), and a job then never starts
server = AgentServer(setup_fnc=prewarm, load_fnc=load, initialize_process_timeout=60.0)


@server.rtc_session(on_request=accept_job)  # marked as ours: recovery.keep_one_agent
async def entrypoint(ctx: JobContext) -> None:
    settings = Settings.load()
    await ctx.connect()
    keep_one_agent(ctx)  # a call that got two agents (a LiveKit restart) keeps one
    participant = await ctx.wait_for_participant()  # a person, or a phone call (kind SIP)
    caller = PhoneCaller.of(participant)
    vad = ctx.proc.userdata["phone_vad" if caller else "vad"]
    session = build_session(settings, tts_url=os.environ["TTS_URL"], llm_url=os.environ["LLM_BASE_URL"],
                            vad=vad, stt=ctx.proc.userdata["stt"], phone=caller is not None)  # fmt: skip
    TurnMetrics(session)  # one log line per turn, with LiveKit's per-turn latencies
    if (provider := ctx.proc.userdata.get("tracer_provider")) is not None:

        async def flush_traces(*_) -> None:  # the call's spans leave before the process may end
            await asyncio.to_thread(provider.force_flush)

        ctx.add_shutdown_callback(flush_traces)

    @session.on("close")
    def _on_close(ev) -> None:  # the caller hung up (or the call ended): free this process now
        reason = f"session closed: {getattr(ev.reason, 'value', ev.reason)}"
        logger.info("call ended (%s): ending the job", reason)
        ctx.shutdown(reason=reason)

    instructions, tools, call = settings.instructions, [], None
    if caller is not None:
        call = PhoneCall(ctx, session, caller, actions=parse_dtmf_actions(settings.dtmf_actions),
                         transfer_to=settings.transfer_to)  # fmt: skip
        instructions = f"{instructions}\n{caller.instructions()}"
        tools = [EndCallTool(), *call.tools()]
        logger.info("phone call %s from %r (trunk %r)", caller.call_id, caller.phone_number,
                    caller.trunk_phone_number)  # fmt: skip
    record = CallRecord(
        ctx, session, keeper_url=settings.keeper_url
    )  # history in the room; heartbeats
    await session.start(
        agent=VoiceAgent(instructions, tools, chat_context(record.resumed)),
        room=ctx.room,
        room_options=room_options(participant.identity, phone=caller is not None),
    )
    record.start()
    ctx.add_shutdown_callback(record.aclose)
    if settings.worker_tag:  # which worker (host) serves this call, for operators and tests
        await ctx.room.local_participant.set_attributes({"worker": settings.worker_tag})
    resumed = bool(record.resumed) or is_resume_dispatch(ctx.job.metadata)
    if resumed:  # this job takes over a call whose agent was lost
        logger.info("resuming a call with %d messages from the room", len(record.resumed))
        if settings.resume_greeting:
            session.say(settings.resume_greeting)
    if call is not None:
        call.start()
        ctx.add_shutdown_callback(lambda *_: _aclose(call))
        if settings.phone_greeting and not resumed:
            session.say(caller.greeting(settings.phone_greeting))


def room_options(identity: str, *, phone: bool) -> RoomOptions:
    """The session's room I/O, linked to `identity`; on a phone call the agent's track is
    published at PHONE_SAMPLE_RATE, the rate its TTS asks the engine for (no resampling on the
    way out)."""
    if phone:
        return RoomOptions(participant_identity=identity,
                           audio_output=AudioOutputOptions(sample_rate=PHONE_SAMPLE_RATE))  # fmt: skip
    return RoomOptions(participant_identity=identity)


async def _aclose(call: PhoneCall) -> None:
    call.close()


def _leave_logging_to_livekit() -> None:
    """LiveKit's CLI adds its own root handler (stdout): the one `voice-agent` added for its own
    start (stderr) would print every line a second time (twice in one file when both go there)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stderr,
            sys.stdout,
        ):
            root.removeHandler(handler)


def run_worker(argv: list[str], settings: Settings) -> int:
    """LiveKit's command `argv` with `settings`, once `voice-agent` has loaded them and found no
    problem (`preflight.preflight_problem`)."""
    command = argv[0] if argv else ""
    settings = resolve_offline(settings)
    if settings.offline:
        os.environ["VOICE_AGENT_OFFLINE"] = "1"  # job processes pick the bundled STT model too
    services: list[LocalService] = []
    try:  # every service started here stops (or is left to its other users) on the way out
        try:
            services.append(ensure_tts_engine(settings))
            services.append(ensure_llm(settings))
        except (RuntimeError, TimeoutError) as e:
            print(f"voice-agent: error: {e}", file=sys.stderr)
            return 1
        tts, llm = services
        for service in services:
            for note in service.notes:
                print(f"NOTE: {note}", file=sys.stderr)
        os.environ["TTS_URL"], os.environ["LLM_BASE_URL"] = tts.url, llm.url
        if llm.model:
            os.environ["LLM_MODEL"] = llm.model
        watch_fleet(settings, tts.url)  # what `load` reports to LiveKit
        # no public setters: two workers on a host need two ports; LiveKit serves /metrics itself
        server._host, server._port = settings.agent_http_host, settings.agent_http_port
        if settings.metrics_port and command in ("start", "dev"):
            server._prometheus_port = settings.metrics_port
        if command == "start":  # dev keeps LiveKit's development default (no limit)
            server.update_options(load_threshold=settings.agent_load_threshold)
        sys.argv = ["voice-agent", *argv]
        _leave_logging_to_livekit()
        cli.run_app(server)
    finally:
        for service in services:
            service.stop()
    return 0
