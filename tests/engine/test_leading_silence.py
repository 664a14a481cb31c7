"""`audio.leading_silence_s`: the silence before the first audible sample, on synthetic audio
(the tiny checkpoints make noise from their first sample, so their leading silence is ~0)."""

import numpy as np
import pytest

from qwen3_tts_engine.audio import leading_silence_s, pcm16

SR = 24000


def _tone(seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * SR)) / SR
    return amplitude * np.sin(2 * np.pi * 440 * t + 0.5)  # phase: its first sample is audible


@pytest.mark.parametrize("silence_s", [0.0, 0.08, 0.3, 1.25])
def test_silence_then_a_tone(silence_s):
    audio = np.concatenate([np.zeros(round(silence_s * SR)), _tone(0.5)])
    for form in (audio, audio.astype(np.float32), pcm16(audio), np.frombuffer(pcm16(audio), "<i2")):
        assert leading_silence_s(form, SR) == pytest.approx(silence_s, abs=1 / SR)


def test_quiet_noise_is_silence_and_a_lone_click_is_not_speech():
    rng = np.random.default_rng(0)
    hiss = rng.normal(0, 10 ** (-55 / 20), round(0.4 * SR))  # -55 dBFS room tone
    hiss[SR // 10] = 0.02  # one click above -40 dBFS, alone in its window
    audio = np.concatenate([hiss, _tone(0.2)])
    assert leading_silence_s(audio, SR) == pytest.approx(0.4, abs=1 / SR)
    assert leading_silence_s(audio, SR, threshold_dbfs=-60) < 0.001  # the hiss is above -60 dBFS


def test_all_silence_is_all_of_it_and_empty_is_zero():
    assert leading_silence_s(np.zeros(SR // 2), SR) == 0.5
    assert leading_silence_s(b"", SR) == 0.0
    assert leading_silence_s(_tone(0.1, amplitude=0.005), SR) == pytest.approx(0.1)  # -46 dBFS


async def test_the_engine_bench_reports_first_audible_as_first_chunk_plus_leading_silence():
    """`bench/engine.py`'s HTTP probe against a loopback server that streams 0.3 s of silence
    (first chunk: all silence) then a tone: first audible - first chunk = the silence, exactly."""
    from aiohttp import web

    from qwen3_tts_engine.bench.engine import _http_first_audio

    audio = pcm16(np.concatenate([np.zeros(round(0.3 * SR)), _tone(0.2)]))

    async def speech(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse()
        await r.prepare(request)
        for i in range(0, len(audio), 7680 * 2):  # 4-frame chunks: the first one is silence
            await r.write(audio[i : i + 7680 * 2])
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]
        first, audible = await _http_first_audio(f"http://127.0.0.1:{port}/v1/audio/speech", {})
    finally:
        await runner.cleanup()
    assert audible - first == pytest.approx(0.3, abs=2 / SR)
