"""No dead air on a real call: a `voice-agent start` worker on a real LiveKit server, two engines.
The worker caches its standby phrases in the engine's voice as the session starts (its log says
so); both engines are then stopped mid-call, and the caller asks a question: the audio the caller
receives over WebRTC holds the hold phrase ("One moment, please.") and then the apology, found by
cross-correlation with the phrases the worker saved (Opus-coded, so similar, not equal), and the
worker's /metrics counts both. Order by events and samples, never by time.
"""

from __future__ import annotations

import asyncio
import os
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest
from livekit import api

from tests.support.engine_process import EngineProcess, free_port
from tests.support.livekit_server import livekit_server  # noqa: F401 (the fixture)
from tests.system.test_livekit_call import (
    WAIT,
    _delete_room,
    _start_worker,
    _stop_worker,
    _until,
    _until_scraped,
)
from voice_agent.harness.caller import RATE, SILENT_PEAK, Caller
from voice_agent.harness.demo import load_turn_audio
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The HMAC key is .* bytes long")]
# The phrases' normalized cross-correlation with the received audio: Opus keeps a phrase well
# above this; another stretch of the same voice's audio stays far below it.
MATCH = 0.5


def _phrase(cache: Path, name: str) -> np.ndarray:
    """A phrase the worker saved (24 kHz), as float at the caller's 48 kHz."""
    [path] = list((cache / "standby").glob(f"*/{name}.wav"))
    with wave.open(str(path), "rb") as w:
        rate, x = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
    t = np.arange(len(x) * RATE // rate) * rate / RATE
    return np.interp(t, np.arange(len(x)), x.astype(np.float64))


def _best_match(audio: np.ndarray, phrase: np.ndarray) -> tuple[float, int]:
    """(peak normalized cross-correlation, offset) of `phrase` in `audio` (FFT, every lag)."""
    n = len(audio) + len(phrase)
    size = 1 << (n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(audio, size) * np.conj(np.fft.rfft(phrase, size)), size)
    corr = corr[: len(audio) - len(phrase) + 1]
    energy = np.convolve(audio**2, np.ones(len(phrase)), "valid")  # audio's energy at each lag
    score = corr / (np.sqrt(energy * np.sum(phrase**2)) + 1e-9)
    at = int(np.argmax(score))
    return float(score[at]), at


async def test_both_engines_stopped_mid_call_the_caller_hears_the_phrase_then_the_apology(
    livekit_server, tiny_checkpoint, tmp_path  # noqa: F811
):  # fmt: skip
    server = livekit_server
    ckpt = tiny_checkpoint("custom_voice", eos="text")
    a, b = EngineProcess(ckpt, None, "--no-governor"), EngineProcess(ckpt, None, "--no-governor")
    await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
    llm = await ScriptedChatServer("Hello there, I am here.", use_tool=False).start()
    metrics_port = free_port()
    cache = tmp_path / "va"
    env = {**os.environ, "LIVEKIT_URL": server.url, "LIVEKIT_API_KEY": server.api_key,
           "LIVEKIT_API_SECRET": server.api_secret, "TTS_URL": f"{a.url},{b.url}",
           "LLM_BASE_URL": llm.url, "LLM_MODEL": "scripted", "VOICE_AGENT_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE": "0",
           "VOICE_AGENT_CACHE": str(cache), "AGENT_HTTP_PORT": "0", "AGENT_LOAD_CPU": "0",
           "METRICS_PORT": str(metrics_port)}  # fmt: skip
    caller = Caller(f"caller-{uuid.uuid4().hex[:6]}", keep_audio=True)
    room = f"air-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "worker.log"
    worker = _start_worker(env, tmp_path, log)

    def worker_alive() -> str | None:
        if worker.poll() is not None:
            return f"the worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}"
        return None

    def logged(what: str):
        return lambda: what in log.read_text(errors="replace")

    try:
        await _until(logged("registered worker"), "the worker to register", alive=worker_alive)
        token = (api.AccessToken(server.api_key, server.api_secret).with_identity(caller.identity)
                 .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())  # fmt: skip
        await caller.join(server.url, token)
        await _until(lambda: caller.listening_agent() is not None, "the agent to listen",
                     alive=worker_alive)  # fmt: skip
        await _until(lambda: caller.mic_subscribed is not None, "the agent's subscription",
                     alive=worker_alive)  # fmt: skip
        # the session's prewarm synthesized the phrases while the engines answered
        await _until(logged("standby phrases cached"), "the phrases", alive=worker_alive)
        await asyncio.gather(asyncio.to_thread(a.stop), asyncio.to_thread(b.stop))  # mid-call
        caller.say(load_turn_audio(speech_wav("Are you there?", sample_rate=RATE)))
        await _until(lambda: caller.speech_end is not None, "the question", alive=worker_alive)
        asked = caller.speech_end
        await _until(lambda: caller.loud_after(asked) is not None, "the agent's audio",
                     alive=worker_alive)  # fmt: skip
        # the reply is over when the agent listens again after it spoke
        spoke = await _until(lambda: any(t > asked and s == "speaking" for t, s in caller.states),
                             "the agent to speak", alive=worker_alive)  # fmt: skip
        await _until(lambda: any(t > spoke and s == "listening" for t, s in caller.states),
                     "the agent to listen again", timeout=WAIT, alive=worker_alive)  # fmt: skip
        scrape = await _until_scraped(
            metrics_port, "voice_agent_tts_standby_total", alive=worker_alive
        )
    except AssertionError as e:
        raise AssertionError(
            f"{e}\n--- worker log ---\n{log.read_text(errors='replace')[-4000:]}"
        ) from None
    finally:
        await caller.close()
        await _delete_room(server, room)
        await asyncio.to_thread(_stop_worker, worker)
        await llm.stop()
        a.stop(), b.stop()

    heard = np.concatenate([x for t, x in caller.audio if t > asked]).astype(np.float64)
    assert np.abs(heard).max() > SILENT_PEAK
    hold, apology = _phrase(cache, "hold"), _phrase(cache, "apology")
    (hold_score, hold_at), (apology_score, apology_at) = (
        _best_match(heard, p) for p in (hold, apology)
    )
    print(f"hold {hold_score:.2f} at {hold_at}, apology {apology_score:.2f} at {apology_at}")
    assert hold_score > MATCH and apology_score > MATCH
    assert hold_at + len(hold) <= apology_at + len(hold) // 4  # the phrase, then the apology
    # each phrase said once (the scrape sums the counter's labels: phrase x source)
    assert scrape["voice_agent_tts_standby_total"] >= 2
    log_text = log.read_text(errors="replace")
    assert (
        "said the hold phrase (engine)" in log_text
        and "said the apology phrase (engine)" in log_text
    )
