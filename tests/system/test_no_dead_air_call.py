"""No dead air on a real call: a `voice-agent start` worker on a real LiveKit server, two engines.
The worker caches its standby phrases in the engine's voice as the session starts (its log says
so); both engines are then stopped mid-call, and the caller asks a question: the audio the caller
receives over WebRTC holds the hold phrase ("One moment, please.") and then the apology, found by
their shape (the stretches of sound heard and their loudness envelopes against the phrases the
worker saved: Opus does not keep this voice's waveform), and the worker's /metrics counts both. Order by events and samples, never by time.
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
# Opus codes the tiny checkpoint's noise-like voice without keeping its waveform (a phrase's
# cross-correlation with what was heard stays below 0.3), so a phrase is recognized by its
# shape: a stretch of sound as long as it (within a quarter, LiveKit's framing and the codec's
# tails), whose loudness envelope follows the phrase's. On a loaded machine the receiver's
# jitter buffer stretches and cuts what it plays (it conceals late packets, then catches up):
# the heard apology drifted 120 ms against the phrase, with local shifts both ways, and its
# plain envelope correlation fell to 0.48-0.65 while the voice was whole. So the envelopes are
# compared along their best alignment within BAND ticks of the proportional one (dynamic time
# warping), and the phrase must match better than the same envelope played backwards.
TICK = RATE // 100  # 10 ms
LOUD, QUIET_GAP = 32.0, 20  # RMS above which a tick is sound; ticks of quiet that end a stretch
# aligned envelope correlation a phrase's stretch reaches (0.93-0.98 seen; 0.77 or more with up to
# eight 30-100 ms cuts or gaps per 3 s put in a heard stretch), and its lead over the reversed
# phrase (0.24-0.75 seen, 0.15 or more with those cuts)
SHAPE, LEAD, BAND = 0.7, 0.1, 8


def _phrase(cache: Path, name: str) -> np.ndarray:
    """A phrase the worker saved (24 kHz), as float at the caller's 48 kHz."""
    [path] = list((cache / "standby").glob(f"*/{name}.wav"))
    with wave.open(str(path), "rb") as w:
        rate, x = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
    t = np.arange(len(x) * RATE // rate) * rate / RATE
    return np.interp(t, np.arange(len(x)), x.astype(np.float64))


def _envelope(x: np.ndarray) -> np.ndarray:
    """RMS per 10 ms."""
    n = len(x) // TICK
    return np.sqrt((x[: n * TICK].reshape(n, TICK) ** 2).mean(axis=1))


def _loud_runs(x: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) 10 ms ticks of each stretch of sound, split where 200 ms are quiet."""
    runs: list[tuple[int, int]] = []
    for i in np.flatnonzero(_envelope(x) > LOUD):
        if runs and i - runs[-1][1] < QUIET_GAP:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _similar(heard: np.ndarray, phrase: np.ndarray, band: int = BAND) -> float:
    """Correlation of two envelopes along their best alignment (dynamic time warping on the
    standardized envelopes), each heard tick within `band` ticks of its proportional place."""
    a, b = ((x - x.mean()) / (x.std() or 1.0) for x in (heard, phrase))
    n, m = len(a), len(b)
    cost = np.full((n + 1, m + 1), np.inf)
    cost[0, 0] = 0.0
    for i in range(1, n + 1):
        mid = round(i * m / n)
        for j in range(max(1, mid - band), min(m, mid + band) + 1):
            best = min(cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1])
            cost[i, j] = (a[i - 1] - b[j - 1]) ** 2 + best
    path, i, j = [], n, m
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        step = int(np.argmin([cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]]))
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    hi, pj = np.array(path).T
    x, y = heard[hi] - heard[hi].mean(), phrase[pj] - phrase[pj].mean()
    return float(x @ y / np.sqrt((x @ x) * (y @ y)))


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
    runs = _loud_runs(heard)
    print(f"stretches heard (10 ms ticks): {runs}; hold {len(hold) // TICK}, apology "
          f"{len(apology) // TICK}")  # fmt: skip
    assert len(runs) == 2, runs  # the phrase, then the apology; nothing else
    for (first, end), phrase in zip(runs, (hold, apology), strict=True):
        ticks = len(phrase) // TICK
        assert abs((end - first) - ticks) <= ticks / 4, (runs, ticks)
        stretch, envelope = _envelope(heard)[first:end], _envelope(phrase)
        shape, backwards = _similar(stretch, envelope), _similar(stretch, envelope[::-1])
        print(f"aligned envelope correlation {shape:.2f} (reversed phrase {backwards:.2f})")
        assert shape > SHAPE and shape > backwards + LEAD, (shape, backwards)
    # each phrase said once (the scrape sums the counter's labels: phrase x source)
    assert scrape["voice_agent_tts_standby_total"] >= 2
    log_text = log.read_text(errors="replace")
    print("\n".join(ln for ln in log_text.splitlines() if "TTS standby:" in ln and "{" not in ln))
    assert (
        "said the hold phrase (engine)" in log_text
        and "said the apology phrase (engine)" in log_text
    )
