"""The plugin and the engine speak one protocol without importing each other: the plugin's
`protocol.py` (client half) and the engine's `protocol.py` (server half) are checked against
each other here: constants and headers, every request field the plugin sends, the status
fields the agent weighs, and the error bodies the plugin reads."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts import protocol as client
from qwen3_tts_engine import protocol as server
from qwen3_tts_engine.dispatch.handler import HandlerError, QueueFull
from qwen3_tts_engine.governor.memory import MemoryReading
from qwen3_tts_engine.governor.policy import Policy
from qwen3_tts_engine.serving.errors import as_request_error

SHARED = ("SAMPLE_RATE", "SAMPLE_RATES", "FRAME_RATE", "FRAME_SAMPLES", "CHUNK_FRAMES", "BYTES_PER_SAMPLE",
          "HEADER_VARIANT", "HEADER_MODEL", "HEADER_SAMPLE_RATE", "HEADER_REQUEST_ID", "LANGUAGES")  # fmt: skip


@pytest.mark.parametrize("name", SHARED)
def test_constants_and_headers_agree(name):
    assert getattr(client, name) == getattr(server, name)


def test_language_names_normalize_the_same_way():
    codes = ["en", "EN", "en_US", "zh-CN", "Mandarin", "jp", "pt-br", "it", "auto", "", None,
             *server.LANGUAGES]  # fmt: skip
    for code in codes:
        assert client.normalize_language(code) == server.normalize_language(code), code
    with pytest.raises(ValueError):
        client.normalize_language("klingon")
    with pytest.raises(server.RequestError):
        server.normalize_language("klingon")


def _all_options(**kw) -> qwen3_tts.TTS:
    return qwen3_tts.TTS(
        base_url="http://127.0.0.1:9", model="qwen3-tts", voice="ryan", language="de",
        instructions="A calm voice.", variant="8bit", temperature=0.7, top_k=40, top_p=0.9,
        repetition_penalty=1.1, max_new_tokens=64, first_chunk_frames=2, **kw,
    )  # fmt: skip


async def test_every_field_the_plugin_sends_parses_on_the_engine():
    tts = _all_options()
    try:
        body = tts._opts.request_body("Guten Tag, wie geht es Ihnen?", seed=7)
    finally:
        await tts.aclose()
    req = server.parse_speech_request(body)
    assert req.input == "Guten Tag, wie geht es Ihnen?"
    assert (req.model, req.voice, req.language) == ("qwen3-tts", "ryan", "german")
    assert (req.variant, req.seed, req.max_new_tokens, req.first_chunk_frames) == ("8bit", 7, 64, 2)
    assert (req.temperature, req.top_k, req.top_p, req.repetition_penalty) == (0.7, 40, 0.9, 1.1)
    assert req.instructions == "A calm voice."
    assert req.stream is True and req.response_format == "pcm"
    # nothing the plugin sends is ignored by the engine: each key is a SpeechRequest field
    assert set(body) <= {f.name for f in fields(server.SpeechRequest)}


async def test_the_vllm_omni_body_parses_too():
    tts = _all_options(protocol="vllm-omni", task_type="custom_voice")
    try:
        body = tts._opts.request_body("Hello there, how are you?", seed=7)
    finally:
        await tts.aclose()
    req = server.parse_speech_request(body)
    assert req.task_type == "custom_voice" and req.voice == "ryan"
    assert "seed" not in body and "variant" not in body  # fields vLLM-Omni does not define


def _status(pressure: float | None, *depths: int) -> dict:
    handlers = [server.HandlerStatus(
        name=f"h{i}", variant="bf16", state="ready", pid=100 + i, active=i == 0, retiring=i > 0,
        queue_depth=d, waiting=max(0, d - 1), restarts=0, last_stats=None, memory={}, info={},
        quantized_modules=0) for i, d in enumerate(depths)]  # fmt: skip
    governor = None
    if pressure is not None:  # the keys the governor's status really has
        reading = MemoryReading(source="manual", limit_bytes=1000, used_bytes=int(pressure * 1000))
        governor = {"pressure": reading.as_dict(), "policy": asdict(Policy())}
    status = server.EngineStatus(model="m", active_variant="bf16", serving=True,
                                 waiting_for_swap=0, handlers=handlers, governor=governor)  # fmt: skip
    return status.to_json()


def test_the_status_fields_the_client_weighs():
    body = _status(0.8, 2, 1)
    assert server.EngineStatus.from_json(body).queue_depth == 3
    load = client.EngineLoad.from_status(body)
    policy = Policy()
    assert load.queue_depth == 3
    assert load.memory_pressure == pytest.approx(0.8)
    assert (load.upgrade_at, load.critical_at) == (policy.upgrade_at, policy.critical_at)
    assert 0 < load.memory_load() < 1
    no_governor = client.EngineLoad.from_status(_status(None, 1))
    assert no_governor.queue_depth == 1 and no_governor.memory_load() == 0.0
    # a newer engine may add fields: both sides ignore what they do not know
    body["handlers"][0]["new_field"] = 1
    body["new_top_level"] = {}
    assert server.EngineStatus.from_json(body).handlers[0].name == "h0"
    assert client.EngineLoad.from_status(body).queue_depth == 3


@pytest.mark.parametrize("err, status", [
    (server.RequestError("unknown voice 'x'", param="voice"), 400),
    (QueueFull("32 requests are already waiting"), 429),
    (server.RequestError("cannot clone without a speech tokenizer encoder", status=400), 400),
    (HandlerError("the TTS worker died"), 503),
])  # fmt: skip
def test_error_bodies_the_plugin_reads(err, status):
    e = as_request_error(err)
    assert e.status == status
    assert client.error_message(e.to_json()) == str(err)
    assert client.error_message({"detail": "not ours"}) is None
