"""Request validation of the speech protocol and ref_audio sourcing (pure, no server)."""

import base64

import pytest

from qwen3_tts_engine.protocol import (
    Limits,
    RequestError,
    check_text,
    default_max_new_tokens,
    normalize_language,
    parse_speech_request,
)
from qwen3_tts_engine.serving.ref_audio import resolve_ref_audio

WAV_HEADER = b"RIFF\x24\x00\x00\x00WAVEfmt "


def test_language_aliases():
    assert normalize_language("en") == "english"
    assert normalize_language("English") == "english"
    assert normalize_language("zh_CN") == "chinese"
    assert normalize_language(None) == "auto"
    with pytest.raises(RequestError, match="unknown language"):
        normalize_language("klingon")


def test_vllm_omni_fields_are_understood():
    req = parse_speech_request({
        "input": "Hi there.", "voice": "ryan", "task_type": "CustomVoice", "language": "English",
        "instructions": "calm", "max_new_tokens": 100, "response_format": "pcm", "stream": True,
    })  # fmt: skip
    assert req.task_type == "custom_voice" and req.language == "english"
    assert req.max_new_tokens == 100 and req.stream and req.response_format == "pcm"


@pytest.mark.parametrize(
    "body",
    [
        [],
        "text",
        {"input": ""},
        {"input": "   "},
        {"input": 5},
        {"voice": "ryan"},
        {"input": "x", "response_format": "ogg"},
        {"input": "x", "stream": "yes"},
        {"input": "x", "stream_format": "chunks"},
        {"input": "x", "stream_format": 1},
        {"input": "x", "response_format": "wav", "stream_format": "sse"},
        {"input": "x", "max_new_tokens": True},
        {"input": "x", "max_new_tokens": 0},
        {"input": "x", "temperature": "hot"},
        {"input": "x", "top_p": 1.5},
        {"input": "x", "task_type": "Clone"},
        {"input": "x", "language": "xx"},
        {"input": "x", "speed": 2.0},
        {"input": "x", "first_chunk_frames": 3},
        {"input": "x", "voice": ["a"]},
        {"input": "x" * 5000},
    ],
)
def test_bad_bodies_are_client_errors(body):
    with pytest.raises(RequestError) as e:
        parse_speech_request(body, Limits(max_input_chars=4000))
    assert 400 <= e.value.status < 500
    assert e.value.to_json()["error"]["message"]


def test_default_max_new_tokens_grows_with_text_and_is_capped():
    assert default_max_new_tokens("Hi.") < default_max_new_tokens("Hi. " * 20)
    assert default_max_new_tokens("x" * 100000) == 4096


def test_ref_audio_sources(tmp_path):
    allowed = tmp_path / "voices"
    allowed.mkdir()
    (allowed / "me.wav").write_bytes(WAV_HEADER + b"\x00" * 64)
    (tmp_path / "secret.wav").write_bytes(WAV_HEADER)
    (allowed / "notes.txt").write_bytes(b"hello")
    data = base64.b64encode(WAV_HEADER + b"\x00" * 64).decode()

    assert resolve_ref_audio(data, None, 1 << 20).startswith(b"RIFF")
    assert resolve_ref_audio("data:audio/wav;base64," + data, None, 1 << 20).startswith(b"RIFF")
    assert resolve_ref_audio("me.wav", allowed, 1 << 20).startswith(b"RIFF")
    for bad, status in [
        ("../secret.wav", 403),
        (str(tmp_path / "secret.wav"), 403),
        ("me.wav\x00", 400),
        ("http://example.invalid/a.wav", 400),
        ("file:///etc/passwd", 400),
        ("missing.wav", 404),
        ("notes.txt", 400),
        (base64.b64encode(b"not audio at all").decode(), 400),
    ]:
        with pytest.raises(RequestError) as e:
            resolve_ref_audio(bad, allowed, 1 << 20)
        assert e.value.status == status, bad
    with pytest.raises(RequestError, match="not accepted"):
        resolve_ref_audio("me.wav", None, 1 << 20)
    with pytest.raises(RequestError) as e:
        resolve_ref_audio(data, None, 10)
    assert e.value.status == 413


REFUSED = [0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0xFDD0, 0xFDEF, 0xFFFE, 0xFFFF, 0x1FFFE, 0x1FFFF,
           0x10FFFE, 0x10FFFF]  # fmt: skip
TAKEN = [0x0, 0x1F, 0x7F, 0x9F, 0xD7FF, 0xE000, 0xFDCF, 0xFDF0, 0xFEFF, 0xFFFD, 0x10000, 0x1FFFD,
         0x20000, 0xE0001, 0x10FFFD]  # fmt: skip


@pytest.mark.parametrize("code", REFUSED)
def test_check_text_refuses_lone_surrogates_and_noncharacters(code):
    """Only Unicode scalar values that are characters: one check, the field named, the code
    point said in an ASCII message (it goes into a WebSocket close reason)."""
    with pytest.raises(RequestError) as e:
        check_text(f"Hello {chr(code)} there", "instructions")
    assert e.value.status == 400 and e.value.param == "instructions"
    assert f"U+{code:04X} at character 6" in e.value.message and e.value.message.isascii()
    for body in (
        {"input": f"Hi {chr(code)}"},
        {"input": "Hi", "instructions": chr(code)},
        {"input": "Hi", "ref_text": chr(code)},
        {"input": "Hi", "voice": chr(code)},
    ):
        with pytest.raises(RequestError) as e:
            parse_speech_request(body)
        assert e.value.param == next(k for k, v in body.items() if chr(code) in v)
    with pytest.raises(RequestError) as e:
        parse_speech_request({"input": f"Hi {chr(code)}"}, text_stream=True)
    assert e.value.param == "input"


def test_check_text_takes_every_other_code_point():
    text = "".join(map(chr, TAKEN)) + "e\u0301 \U0001f469\u200d\U0001f467 \u202eשלום"
    assert check_text(text, "input") is text
