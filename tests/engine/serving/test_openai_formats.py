"""Every OpenAI speech client works: the real `openai` SDK against the engine server on
127.0.0.1 — each response format, whole and streamed (`stream_format="audio"`), server-sent
events (`stream_format="sse"`), OpenAI voice names — decoded back (PyAV) and compared with the
PCM of the same request (same seed, so the same samples).

pcm, wav and flac must give the very samples. The lossy formats are held to their codec: on
speech (espeak-ng, through the same encoder) SNR >= 20 dB; the tiny random checkpoint's audio
is noise-like, which perceptual codecs do not keep sample by sample, so there the check is the
length and a positive aligned SNR, and streamed == whole."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import wave

import av
import httpx
import numpy as np
import openai
import pytest

from qwen3_tts_engine.audio import AudioEncoder
from qwen3_tts_engine.protocol import CONTENT_TYPES, FRAME_SAMPLES, OPENAI_VOICE_ALIASES

pytestmark = pytest.mark.slow
TEXT = "Hello there, how are you?"
FRAMES = 4  # in two chunks of 2 frames (first_chunk_frames=2): a stream of more than one chunk
LOSSY = ("mp3", "opus", "aac")
EXTRA = {"seed": 5, "max_new_tokens": FRAMES, "first_chunk_frames": 2}


@pytest.fixture(scope="module")
def engine_url(engine):  # the module's in-process engine (conftest)
    return f"http://127.0.0.1:{engine.port}"


@pytest.fixture
async def client(engine_url):
    c = openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


def decode(data: bytes, fmt: str) -> np.ndarray:
    """int16 mono samples at 24 kHz, whatever the container."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2")
    out = []
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=24000)
        for frame in container.decode(audio=0):
            out += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(out)


def aligned_snr(ref: np.ndarray, x: np.ndarray, max_lag: int = 4096) -> float:
    """SNR of `x` against `ref` after the codec's delay (the lag that correlates best)."""
    r, y = ref.astype(np.float64), x.astype(np.float64)
    lags = [lag for lag in range(max_lag + 1) if len(y) - lag >= len(r)]
    assert lags, (len(r), len(y))
    lag = max(lags, key=lambda k: float(np.dot(y[k : k + len(r)], r)))
    err = r - y[lag : lag + len(r)]
    return float(10 * np.log10(np.sum(r**2) / max(np.sum(err**2), 1e-9)))


@pytest.fixture(scope="module")
async def reference(engine_url):
    async with openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="unused") as c:
        r = await c.audio.speech.create(model="tts-1", voice="vivian", input=TEXT,
                                        response_format="pcm", extra_body=EXTRA)  # fmt: skip
    pcm = np.frombuffer(r.content, "<i2")
    assert len(pcm) == FRAMES * FRAME_SAMPLES and np.abs(pcm).max() > 0
    return pcm


def check_audio(fmt: str, samples: np.ndarray, ref: np.ndarray) -> None:
    if fmt in LOSSY:
        assert len(ref) <= len(samples) <= len(ref) + 4096, (fmt, len(samples))
        assert aligned_snr(ref, samples) > 3.0, fmt
    else:
        np.testing.assert_array_equal(samples, ref)


@pytest.mark.parametrize("fmt", list(CONTENT_TYPES))
async def test_every_format_whole_and_streamed(client, reference, fmt):
    whole = await client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                             response_format=fmt, extra_body=EXTRA)  # fmt: skip
    assert whole.response.headers["content-type"] == CONTENT_TYPES[fmt]
    check_audio(fmt, decode(whole.content, fmt), reference)
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, stream_format="audio",
        extra_body=EXTRA,
    ) as resp:  # fmt: skip
        assert resp.headers["content-type"] == CONTENT_TYPES[fmt]
        streamed = b"".join([part async for part in resp.iter_bytes()])
    if fmt == "wav":  # cannot stream (the header states the length): the whole file comes
        assert streamed == whole.content
    else:
        assert resp.headers.get("transfer-encoding") == "chunked"
        np.testing.assert_array_equal(decode(streamed, fmt), decode(whole.content, fmt))


def sse_events(body: bytes) -> list[dict]:
    """A plain server-sent-events parser: one JSON object per `data:` event."""
    events = []
    for block in body.decode().split("\n\n"):
        data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if data:
            events.append(json.loads("\n".join(data)))
    return events


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
async def test_server_sent_events(client, reference, fmt):
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=fmt, stream_format="sse",
        extra_body=EXTRA,
    ) as resp:  # fmt: skip
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(await resp.read())
    *deltas, done = events
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == FRAMES and usage["input_tokens"] == len(TEXT)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    check_audio(fmt, decode(audio, fmt), reference)


async def test_openai_voice_names(client, engine_url, reference):
    async with httpx.AsyncClient() as c:
        models = (await c.get(f"{engine_url}/v1/models")).json()["data"][0]
    assert models["voice_aliases"]["alloy"] == OPENAI_VOICE_ALIASES["alloy"] == "vivian"
    assert set(models["voice_aliases"]) == set(OPENAI_VOICE_ALIASES)  # all targets are voices
    r = await client.audio.speech.create(model="tts-1", voice="Alloy", input=TEXT,
                                         response_format="pcm", extra_body=EXTRA)  # fmt: skip
    np.testing.assert_array_equal(np.frombuffer(r.content, "<i2"), reference)  # vivian's audio
    with pytest.raises(openai.BadRequestError, match="unknown voice 'nobody'"):
        await client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)


async def test_defaults_and_bad_values(client, engine_url):
    r = await client.audio.speech.create(model="tts-1", voice="ash", input=TEXT, extra_body=EXTRA)
    assert r.response.headers["content-type"] == "audio/mpeg"  # OpenAI's default format
    assert len(decode(r.content, "mp3")) >= FRAMES * FRAME_SAMPLES
    bad = [({"stream_format": "chunks"}, "stream_format"), ({"response_format": "ogg"}, "response_format"),
           ({"response_format": "wav", "stream_format": "sse"}, "response_format"), ({"speed": 1.5}, "speed")]  # fmt: skip
    async with httpx.AsyncClient(base_url=engine_url) as c:
        for extra, param in bad:
            r = await c.post("/v1/audio/speech", json={"input": TEXT, "voice": "ryan", **extra})
            assert r.status_code == 400, extra
            assert r.json()["error"]["param"] == param


def _espeak_speech(tmp_path) -> np.ndarray:
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "The meeting has been moved to Thursday "
                    "afternoon at three. Please bring the report."], check=True)  # fmt: skip
    with wave.open(str(wav)) as w:
        rate, x = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    t = np.arange(int(len(x) * 24000 / rate)) * rate / 24000
    return np.interp(t, np.arange(len(x)), x.astype(np.float64)).astype("<i2")


@pytest.mark.parametrize("fmt", [*LOSSY, "flac"])
def test_encoders_keep_speech(fmt, tmp_path):
    """The response encoders on real speech, fed in 320 ms chunks as the server feeds them."""
    speech = _espeak_speech(tmp_path)
    pcm, encoder, out = speech.tobytes(), AudioEncoder(fmt), b""
    for i in range(0, len(pcm), 2 * 7680):
        out += encoder.encode(pcm[i : i + 2 * 7680])
    out += encoder.finish()
    decoded = decode(out, fmt)
    if fmt == "flac":
        np.testing.assert_array_equal(decoded, speech)
    else:
        assert aligned_snr(speech, decoded) >= 20.0, fmt
