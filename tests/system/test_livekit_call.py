"""The call test: a real `voice-agent start` worker on a real LiveKit server, called over WebRTC.

A caller joins a room with LiveKit's Python SDK and speaks (espeak-ng, 10 ms frames in real time);
the worker is dispatched to the room, hears it (Silero + faster-whisper tiny.en), asks the scripted
LLM, answers with a tiny Qwen3-TTS checkpoint through the engine server, and the caller receives
the agent's audio track and the `lk.transcription` text streams. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from livekit import api

from tests.infra.test_observability_infra import dashboard_metric_names
from tests.support.engine_process import EngineProcess, free_port
from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.support.otlp_collector import OTLPCollector
from voice_agent.harness.caller import RATE, SILENT_PEAK, Caller
from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.lab.turn_bench import word_error_rate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long"),
]  # devkey/secret
QUESTION = "What time is it right now?"
WAIT = 120.0  # every wait in this test is bounded by this


async def _until(cond, what: str, timeout: float = WAIT, alive=None) -> float:
    """Poll `cond()` until true; returns the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        if alive is not None and (problem := alive()):
            raise AssertionError(f"while waiting for {what}: {problem}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _heard(caller: Caller, question: str) -> bool:
    """Whether the agent's final transcript of the caller's speech is the question, as tiny.en
    hears Opus-coded WebRTC audio: most of its words, not always every one ("What's time...",
    "Watt time...", and on a loaded machine "What? I-Is it right now?"): a word error rate of at
    most one half."""
    return any(word_error_rate(question, text) <= 0.5 for text in caller.user_texts(final=True))


def _stop_worker(proc: subprocess.Popen) -> None:
    """SIGTERM the worker (it drains and stops its job processes), then sweep its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    proc.wait(10)


async def _delete_room(server, room: str) -> None:
    lk = api.LiveKitAPI(server.http_url, server.api_key, server.api_secret)
    try:
        await asyncio.wait_for(lk.room.delete_room(api.DeleteRoomRequest(room=room)), 10)
    except Exception as e:  # the room may not exist (the caller never joined)
        print(f"could not delete room {room}: {e}")
    finally:
        await lk.aclose()


def _start_worker(env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """`voice-agent start` in its own process group (its job processes stop with it)."""
    exe = str(Path(sys.executable).with_name("voice-agent"))
    with open(log, "wb") as fh:  # cwd: a temporary folder, so no .env of the repo is read
        return subprocess.Popen([exe, "start", "--log-level", "INFO"], cwd=cwd, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


async def test_call_through_a_livekit_server(livekit_server, tiny_checkpoint, tmp_path,  # noqa: F811
                                             record_property):  # fmt: skip
    server = livekit_server
    collector = await OTLPCollector().start()  # the worker's and the engine's traces
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    engine = EngineProcess(tiny_checkpoint("custom_voice"), None, "--no-governor", env=otel)
    await asyncio.to_thread(engine.start)
    llm = await ScriptedChatServer().start()
    metrics_port = free_port()
    question = load_turn_audio(speech_wav(QUESTION, sample_rate=RATE))
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
           "LIVEKIT_API_SECRET": server.api_secret, "TTS_URL": engine.url, "LLM_BASE_URL": llm.url,
           "LLM_MODEL": "scripted", "TTS_MAX_NEW_TOKENS": "6", "VOICE_AGENT_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
           "VOICE_AGENT_CACHE": str(tmp_path / "va"),
           "AGENT_HTTP_PORT": "0",  # any free port: other tests may run workers meanwhile
           "AGENT_LOAD_CPU": "0",  # a busy CI machine must not keep the agent out
           "METRICS_PORT": str(metrics_port), **otel}  # fmt: skip
    caller = Caller(f"caller-{uuid.uuid4().hex[:6]}")
    room = f"call-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "worker.log"
    t_start = time.monotonic()
    worker = _start_worker(env, tmp_path, log)

    def worker_alive() -> str | None:
        if worker.poll() is not None:
            return f"the worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}"
        return None

    try:
        t_registered = await _until(lambda: "registered worker" in log.read_text(errors="replace"),
                                    "the worker to register", alive=worker_alive)  # fmt: skip
        registered_s = t_registered - t_start
        print(f"worker registered {registered_s:.2f}s after start")
        record_property("worker_registered_s", round(registered_s, 3))

        token = (api.AccessToken(server.api_key, server.api_secret).with_identity(caller.identity)
                 .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip
        await caller.join(server.url, token)
        t_joined = time.monotonic()
        await _until(lambda: (a := caller.agent()) is not None
                     and a.attributes.get("lk.agent.state") == "listening",
                     "the agent to join and listen", alive=worker_alive)  # fmt: skip
        print(f"agent listening {time.monotonic() - t_joined:.2f}s after the caller joined")
        # LiveKit tells the caller when the agent has subscribed to its microphone: from then on
        # the agent hears what it says
        await _until(lambda: caller.mic_subscribed is not None, "the agent's subscription to the microphone",
                     alive=worker_alive)  # fmt: skip
        # asked again after a LiveKit reconnect until the answer is whole: a resumed transport
        # (a loaded machine) may lose the question's audio or the end of the answer's text stream
        caller.ask(question, answered=lambda: "noon" in caller.agent_transcript().lower())
        await _until(
            lambda: caller.speech_end is not None, "the question to be spoken", alive=worker_alive
        )

        def agent_spoke() -> bool:
            return any(
                t > caller.speech_end and peak > SILENT_PEAK for t, peak in caller.agent_frames
            )

        await _until(agent_spoke, "the agent's audio", alive=worker_alive)
        first = min(
            t for t, peak in caller.agent_frames if t > caller.speech_end and peak > SILENT_PEAK
        )
        voice_to_voice = first - caller.speech_end
        await _until(lambda: _heard(caller, QUESTION), "the user's transcript", alive=worker_alive)
        await _until(lambda: "noon" in caller.agent_transcript().lower(),
                     "the agent's transcript", alive=worker_alive)  # fmt: skip
        # the worker's /metrics carries the turn, observed in its job process
        scrape = await _until_scraped(metrics_port, "voice_agent_turns_total", alive=worker_alive)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- worker log ---\n{log.read_text(errors='replace')[-4000:]}"
                             f"\n--- transcripts: {caller.transcripts} (open: {caller.open_texts})"
                             f"\n--- the caller's connection: {caller.connection_events}") from None  # fmt: skip
    finally:
        await caller.close()
        await _delete_room(server, room)  # else the job waits out the room's departure timeout
        await asyncio.to_thread(_stop_worker, worker)  # the job's spans are flushed as it ends
        await llm.stop()
        await asyncio.to_thread(engine.stop)  # the engine's too
        await collector.stop()

    print(f"voice-to-voice seen by the caller: {voice_to_voice:.3f}s")
    print(f"transcripts: {caller.transcripts}")
    record_property("voice_to_voice_s", round(voice_to_voice, 3))
    assert _heard(caller, QUESTION), caller.transcripts
    assert "noon" in caller.agent_transcript().lower(), caller.transcripts
    # the scripted LLM was asked for the tool, then answered with the tool's result
    assert any(m.get("role") == "tool" for m in llm.requests[-1]["messages"]), llm.requests
    loud = [peak for t, peak in caller.agent_frames if t > caller.speech_end and peak > SILENT_PEAK]
    assert len(loud) >= 10, f"only {len(loud)} non-silent agent frames"
    print(f"worker exit code: {worker.returncode}")

    # Metrics: LiveKit's worker endpoint aggregates the job process's turn metrics (multiprocess)
    # with its own job gauge (main process), every series in one scrape.
    assert scrape["voice_agent_turns_total"] >= 1
    for name in ("end_of_turn_delay", "transcription_delay", "llm_node_ttft", "tts_node_ttfb",
                 "e2e_latency", "added_latency"):  # fmt: skip
        assert scrape[f"voice_agent_{name}_seconds_count"] >= 1, name
    assert "lk_agents_active_job_count" in scrape and "voice_agent_errors_total" in scrape
    dashboard = {
        n for n in dashboard_metric_names() if n.startswith(("voice_agent_", "lk_agents_"))
    }
    assert dashboard and dashboard <= scrape_families(scrape), dashboard - scrape_families(scrape)

    # Traces: the turn's STT, LLM and TTS spans in one trace, and the engine's span as the child
    # of the plugin's request (W3C traceparent). The agent's default text input streams each
    # segment over the engine's WebSocket: `qwen3_tts.text_stream` -> the engine's span of that
    # utterance, `qwen3_tts.utterance` (its socket may have been opened earlier, by prewarm(): the
    # utterance's start carries its traceparent), under the socket's `qwen3_tts.speech_stream`.
    names = {s.name for s in collector.spans if s.service == "voice-agent"}
    assert {"user_turn", "stt_request", "llm_node", "tts_node", "qwen3_tts.text_stream"} <= names, (
        names
    )
    spans = collector.by_id()
    assert collector.named("qwen3_tts.speech_stream")
    engine_spans = collector.named("qwen3_tts.utterance")
    assert engine_spans and all(s.service == "qwen3-tts-engine" for s in engine_spans)
    linked = [s for s in engine_spans if spans.get(s.parent_span_id) is not None
              and spans[s.parent_span_id].name == "qwen3_tts.text_stream"]  # fmt: skip
    assert linked, [(s.name, s.parent_span_id) for s in engine_spans]
    speech = linked[0]
    request = spans[speech.parent_span_id]
    assert speech.trace_id == request.trace_id and speech.attributes["qwen3_tts.frames"] > 0
    children = {s.name for s in collector.spans if s.parent_span_id == speech.span_id}
    assert children == {"qwen3_tts.queue", "qwen3_tts.synthesis"}, children
    # ...and that trace is the turn's: the request hangs under LiveKit's tts_node
    chain, span = [], request
    while span is not None:
        chain.append(span.name)
        span = spans.get(span.parent_span_id)
    assert "tts_node" in chain, chain


async def _until_scraped(port: int, sample: str, alive) -> dict[str, float]:
    """GET /metrics until `sample` is in it; {sample name with labels: value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}

    def scraped() -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return False
        out.clear()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value  # summed over labels
        return out.get(sample, 0) >= 1

    await _until(scraped, f"{sample} on the worker's /metrics", alive=alive)
    return dict(out)


def scrape_families(scrape: dict[str, float]) -> set[str]:
    """Metric names as the dashboard writes them: samples, and families without suffixes."""
    names = set(scrape)
    for n in scrape:
        for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
            if n.endswith(suffix):
                names.add(n.removesuffix(suffix))
    return names
