"""Phone-rate audio: a request's `sample_rate` (8, 16, 24 or 48 kHz), resampled in the server
process by `audio.Resampler`, on POST (every format, the X-Sample-Rate header, the WAV header)
and on the WebSocket (`session.created`, the binary chunks). The resampler's own tests run
without a server; the rest on the session's in-process engine (the tiny checkpoint)."""

from __future__ import annotations

import io
import wave

import aiohttp
import av
import httpx
import numpy as np
import pytest

from qwen3_tts_engine.audio import Resampler, encode_whole, lowpass_filter
from qwen3_tts_engine.protocol import (
    CONTENT_TYPES,
    FRAME_SAMPLES,
    HEADER_SAMPLE_RATE,
    SAMPLE_RATE,
    SPEECH_STREAM_PATH,
    SPEECH_STREAM_SUBPROTOCOL,
    RequestError,
    parse_speech_request,
)
from tests.support.speech_socket import until_done

TEXT = "Hello there, how are you?"
FRAMES = 4  # in two chunks of 2 frames: a stream of more than one chunk
EXTRA = {"voice": "ryan", "seed": 5, "max_new_tokens": FRAMES, "first_chunk_frames": 2}
START = {"type": "session.start", "voice": "ryan", "language": "en", "seed": 3}
HANG_GUARD = 120


def _noise(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.standard_normal(n) * 8000, -32768, 32767).astype("<i2")


def _resample(pcm: bytes, rate: int) -> bytes:
    return Resampler(SAMPLE_RATE, rate).process(pcm)


# -- the resampler ---------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_resampling_is_one_shot_resampling(rate, seed):
    """The docstring's tolerance, 0 LSB: any cut of the input (empty and one-sample chunks
    among them) gives the very samples of the whole in one call; each chunk gives its share
    (len * rate / 24000) to within one sample, and the whole exactly ceil(n * rate / 24000)."""
    x = _noise(40_000 + seed, seed)
    one_shot = _resample(x.tobytes(), rate)
    assert len(one_shot) // 2 == -(-len(x) * rate // SAMPLE_RATE)
    rng = np.random.default_rng(100 + seed)
    resampler, out, i = Resampler(SAMPLE_RATE, rate), [], 0
    while i < len(x):
        piece = x[i : i + int(rng.choice([0, 1, 2, 7, int(rng.integers(1, 9000))]))]
        part, n = resampler.process(piece.tobytes()), len(piece)
        assert abs(len(part) // 2 - n * rate / SAMPLE_RATE) < 1 + 1e-9, (n, len(part))
        out.append(part)
        i += n
    assert b"".join(out) == one_shot


def test_same_rate_passes_through():
    pcm = _noise(1000, 3).tobytes()
    assert Resampler(SAMPLE_RATE, SAMPLE_RATE).process(pcm) == pcm


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_the_filter_is_resample_polys(rate):
    """The filter is scipy's resample_poly default, and the output upfirdn's cut to length (to
    within 1 LSB: rounding of the same sums)."""
    from scipy import signal  # installed with the engine's dependencies (uv.lock)

    r = Resampler(SAMPLE_RATE, rate)
    m = max(r.up, r.down)
    h = signal.firwin(2 * 10 * m + 1, 1.0 / m, window=("kaiser", 5.0)) * r.up
    np.testing.assert_allclose(lowpass_filter(r.up, r.down), h, rtol=0, atol=1e-12)
    x = _noise(20_000, 4)
    y = np.frombuffer(r.process(x.tobytes()), "<i2").astype(np.int32)
    ref = signal.upfirdn(h, x.astype(np.float64), r.up, r.down)[: len(y)]
    ref = np.clip(np.rint(ref), -32768, 32767)
    assert np.abs(y - ref).max() <= 1


def test_a_tone_keeps_and_what_a_phone_cannot_carry_goes():
    """A 1 kHz tone comes out at 8 kHz as that tone (after the filter's 10-sample delay); a
    6 kHz tone (above 8 kHz's 4 kHz Nyquist) is filtered out, not folded down to 2 kHz."""
    t = np.arange(24_000) / SAMPLE_RATE
    tone = (np.sin(2 * np.pi * 1000 * t) * 10_000).astype("<i2")
    y = np.frombuffer(_resample(tone.tobytes(), 8000), "<i2").astype(np.float64)
    want = np.sin(2 * np.pi * 1000 * (np.arange(len(y)) - 10) / 8000) * 10_000
    assert np.abs(y[100:-100] - want[100:-100]).max() < 100  # < 1 % of the amplitude
    high = (np.sin(2 * np.pi * 6000 * t) * 10_000).astype("<i2")
    y = np.frombuffer(_resample(high.tobytes(), 8000), "<i2").astype(np.float64)
    assert np.sqrt(np.mean(y[100:-100] ** 2)) < 10_000 / np.sqrt(2) / 100  # > 40 dB down


# -- the request field -----------------------------------------------------------------------


def test_the_sample_rate_field():
    assert parse_speech_request({"input": "Hi."}).sample_rate == SAMPLE_RATE == 24000
    for rate in (8000, 16000, 24000, 48000):
        assert parse_speech_request({"input": "Hi.", "sample_rate": rate}).sample_rate == rate
        assert parse_speech_request({"sample_rate": rate}, text_stream=True).sample_rate == rate
    for bad in (44100, 22050, 0, -8000, "16000", 16000.0, True):
        with pytest.raises(RequestError) as e:
            parse_speech_request({"input": "Hi.", "sample_rate": bad})
        assert e.value.status == 400 and e.value.param == "sample_rate", bad


def _decoded(body: bytes, fmt: str) -> tuple[int, np.ndarray]:
    """The rate a file states and its samples. Opus always decodes at 48 kHz: its rate is the
    input rate its header (OpusHead) states."""
    with av.open(io.BytesIO(body)) as container:
        rate = container.streams.audio[0].rate
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    if fmt == "opus":
        head = body.index(b"OpusHead")
        rate = int.from_bytes(body[head + 12 : head + 16], "little")
    return rate, samples


@pytest.mark.parametrize("fmt", [f for f in CONTENT_TYPES if f != "pcm"])
def test_every_format_is_written_at_the_rate(fmt):
    pcm = _resample(_noise(7680, 5).tobytes(), 8000)
    assert _decoded(encode_whole(pcm, fmt, 8000), fmt)[0] == 8000, fmt


# -- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_url(engine):  # the session's in-process engine (conftest)
    return f"http://127.0.0.1:{engine.port}"


async def _post(url: str, **body) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD) as c:
        return await c.post("/v1/audio/speech", json={"input": TEXT, **EXTRA, **body})


@pytest.fixture(scope="module")
async def reference(engine_url) -> bytes:
    """The 24 kHz PCM of the request the tests ask at other rates (same seed: same samples)."""
    r = await _post(engine_url, response_format="pcm")
    assert r.status_code == 200 and r.headers[HEADER_SAMPLE_RATE] == "24000"
    assert len(r.content) == FRAMES * FRAME_SAMPLES * 2
    return r.content


@pytest.mark.slow
@pytest.mark.parametrize("rate", [8000, 16000, 48000])  # 48 kHz: upsampled by the server too
async def test_post_pcm_and_wav_at_phone_rates(engine_url, reference, rate):
    """pcm (whole and streamed) and wav at the rate: the header says it, the WAV header says it,
    and the samples are the 24 kHz reference's resampled (FRAMES * 1920 * rate / 24000)."""
    want = _resample(reference, rate)
    assert len(want) == FRAMES * FRAME_SAMPLES * rate // SAMPLE_RATE * 2
    for stream in (False, True):
        r = await _post(engine_url, response_format="pcm", sample_rate=rate, stream=stream)
        assert r.status_code == 200 and r.headers[HEADER_SAMPLE_RATE] == str(rate)
        assert r.content == want, stream
    r = await _post(engine_url, response_format="wav", sample_rate=rate)
    assert r.status_code == 200 and r.headers[HEADER_SAMPLE_RATE] == str(rate)
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getframerate() == rate and w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.readframes(w.getnframes()) == want


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
async def test_post_compressed_formats_at_8k(engine_url, reference, fmt):
    r = await _post(engine_url, response_format=fmt, sample_rate=8000, stream=True)
    assert r.status_code == 200 and r.headers[HEADER_SAMPLE_RATE] == "8000"
    rate, samples = _decoded(r.content, fmt)
    n = len(samples) // (6 if fmt == "opus" else 1)  # opus decodes at 48 kHz
    assert rate == 8000
    # an encoder's priming and padding: mp3 and aac add up to ~2 frames of 1152 or 1024 samples
    assert FRAMES * 640 <= n <= FRAMES * 640 + 2304, (fmt, n)
    if fmt == "flac":  # lossless: the very samples
        assert samples.astype("<i2").tobytes() == _resample(reference, 8000)


@pytest.mark.slow
async def test_post_refuses_44100(engine_url):
    r = await _post(engine_url, response_format="pcm", sample_rate=44100)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "sample_rate" and "sample_rate" in error["message"]


async def _session(url: str, start: dict, pieces: list[str]) -> list:
    """A whole socket session: every message, JSON events as dicts, audio as bytes."""
    async with aiohttp.ClientSession(url) as s, s.ws_connect(
        SPEECH_STREAM_PATH, protocols=(SPEECH_STREAM_SUBPROTOCOL,),
        timeout=aiohttp.ClientWSTimeout(ws_close=HANG_GUARD),
    ) as ws:  # fmt: skip
        await ws.send_json(start)
        for piece in pieces:
            await ws.send_json({"type": "input_text.append", "text": piece})
        if pieces:
            await ws.send_json({"type": "input_text.end"})
        return await until_done(ws)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [8000, 16000])
async def test_socket_at_phone_rates(engine_url, rate):
    """session.created says the rate; each binary chunk is its frames' 1920 samples at 24 kHz
    times rate / 24000 (exactly: 1920 is a multiple of 3), response.done counts samples at the
    rate, and the audio is the same text's over POST at that rate (dual-track, same seed) to
    within the rounding of chunked decoding (16 LSB at 24 kHz, through the filter's gain)."""
    words = TEXT.split(" ")
    events = await _session(engine_url, {**START, "sample_rate": rate},
                            [w + " " for w in words[:-1]] + [words[-1]])  # fmt: skip
    created, done = events[0], events[-1]
    assert created["type"] == "session.created" and created["sample_rate"] == rate
    assert done["type"] == "response.done"
    assert not [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    chunks = [e for e in events if isinstance(e, bytes)]
    per_frame = FRAME_SAMPLES * rate // SAMPLE_RATE
    assert chunks and all(len(c) % (2 * per_frame) == 0 for c in chunks)
    assert len(chunks[0]) <= 2 * 2 * per_frame and max(map(len, chunks)) <= 4 * 2 * per_frame
    pcm = b"".join(chunks)
    assert done["samples"] * 2 == len(pcm) == done["frames"] * per_frame * 2
    r = await _post(engine_url, **{k: v for k, v in START.items() if k != "type"}, text_mode="dual",
                    response_format="pcm", sample_rate=rate, max_new_tokens=None,
                    first_chunk_frames=None)  # fmt: skip
    assert r.status_code == 200
    a, b = (np.frombuffer(x, "<i2").astype(np.int32) for x in (pcm, r.content))
    assert len(a) == len(b) > 0
    r_ = Resampler(SAMPLE_RATE, rate)
    h = lowpass_filter(r_.up, r_.down)
    gain = max(np.abs(h[p :: r_.up]).sum() for p in range(r_.up))  # the most one LSB can grow
    assert np.abs(a - b).max() <= np.ceil(16 * gain) + 1


@pytest.mark.slow
async def test_socket_refuses_44100(engine_url):
    events = await _session(engine_url, {**START, "sample_rate": 44100}, [])
    error = events[-1]
    assert error["type"] == "error" and error["status"] == 400
    assert error["error"]["param"] == "sample_rate"
