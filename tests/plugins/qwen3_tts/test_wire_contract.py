"""The plugin and the engine speak one protocol without importing each other: the plugin's
`protocol.py` (client half) and the engine's `protocol.py` (server half) are checked against
each other here: constants and headers, every request field the plugin sends, the load report
(`GET /load`) the plugin's fleet contract reads and its rule for free slots, and the error bodies
the plugin reads."""

from __future__ import annotations

import itertools
from dataclasses import MISSING, fields

import pytest
from livekit.plugins import qwen3_tts

from livekit.plugins.qwen3_tts import fleet
from livekit.plugins.qwen3_tts import protocol as client
from qwen3_tts_engine import protocol as server
from qwen3_tts_engine.dispatch.engine import free_slots as engine_free_slots
from qwen3_tts_engine.dispatch.handler import HandlerError, QueueFull
from qwen3_tts_engine.serving.errors import as_request_error

SHARED = ("SAMPLE_RATE", "SAMPLE_RATES", "FRAME_RATE", "FRAME_SAMPLES", "CHUNK_FRAMES", "BYTES_PER_SAMPLE",
          "HEADER_VARIANT", "HEADER_MODEL", "HEADER_SAMPLE_RATE", "HEADER_REQUEST_ID", "LANGUAGES",
          "SPEECH_STREAM_PATH", "SPEECH_STREAM_SUBPROTOCOL", "HEADER_CAPPED", "HEADER_FINISH_REASON",
          "FINISH_REASONS")  # fmt: skip


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


# -- the fleet contract: the engine's LoadReport (schema) and rule vs the plugin's fleet module ---


def test_every_load_field_the_plugin_reads_is_one_the_engine_writes_with_the_same_default():
    """`fleet.Capacity` is a view of `protocol.LoadReport`: each of its fields is a field of the
    report, with the same type and (where the report has one) the same default."""
    report = {f.name: f for f in fields(server.LoadReport)}
    for f in fields(fleet.Capacity):
        assert f.name in report, f"the plugin reads {f.name!r}, which /load does not carry"
        assert f.type == report[f.name].type, f.name
        if report[f.name].default is not MISSING:
            assert f.default == report[f.name].default, f.name
    # what routers and the agent weigh is all there
    assert {"running", "waiting", "slots", "free_slots", "accepting", "state", "server_load",
            "memory_pressure", "memory_load"} <= {f.name for f in fields(fleet.Capacity)}  # fmt: skip


def test_a_report_reads_back_whole_and_a_newer_engines_fields_are_ignored():
    body = server.LoadReport(running=2, waiting=1, max_batch=8, slots=4, free_slots=1,
                             accepting=True, state="serving", underruns=0, server_load=3,
                             memory_pressure=0.7, memory_load=0.2).to_json()  # fmt: skip
    load = fleet.Capacity.from_json({**body, "a_field_from_the_future": {}})
    assert load == fleet.Capacity(running=2, waiting=1, slots=4, free_slots=1, accepting=True,
                                  state="serving", max_batch=8, server_load=3,
                                  memory_pressure=0.7, memory_load=0.2)  # fmt: skip
    assert server.LoadReport.from_json(
        {**body, "a_field_from_the_future": {}}
    ) == server.LoadReport(**body)
    assert fleet.Capacity.from_json({"server_load": 3}) is None  # vLLM's /load: not a report


@pytest.mark.parametrize("state", server.LOAD_STATES)
def test_free_means_the_same_on_both_sides(state):
    """The engine's one rule (`dispatch.engine.free_slots`, what /load says) and the plugin's
    (`fleet.free_slots` of that report with its own streams) agree in every state, at every
    memory load and with the batch under, at and over its slots."""
    for slots, streams, memory_load in itertools.product((1, 4), (0, 1, 4, 6), (0.0, 0.5, 1.0)):
        free = engine_free_slots(state, slots, streams, memory_load)
        report = server.LoadReport(running=min(streams, slots), waiting=max(0, streams - slots),
                                   max_batch=8, slots=slots, free_slots=free,
                                   accepting=state in ("serving", "swapping"), state=state,
                                   underruns=0, server_load=streams, memory_load=memory_load)  # fmt: skip
        load = fleet.Capacity.from_json(report.to_json())
        mine = fleet.free_slots(load, fleet.others(load, 0), 0)
        assert max(0, mine) == free, (state, slots, streams, memory_load)
        assert load.takes_new == (free > 0 or (state == "serving" and memory_load < 1))
    assert fleet.free_slots(None) is None  # no report: unknown


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
