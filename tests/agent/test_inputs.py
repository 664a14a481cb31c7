"""What a user gives `voice-agent demo` is checked before anything starts, and a failure inside a
turn ends it at once: turn audio in any format FFmpeg decodes (PyAV), setting values checked at
parse time (flags, environment, .env), and a TTS request the engine refuses (unknown voice)."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import subprocess
import sys
import uuid
import wave
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from tests.support.engine_process import free_port
from voice_agent.cli import build_parser
from voice_agent.harness.conversation import TurnFailed
from voice_agent.harness.demo import (
    INPUT_RATE,
    TurnAudioError,
    check_output,
    check_voice,
    load_turn_audio,
    run_turns,
)
from voice_agent.harness.openai_stand_in import ScriptedChatServer
from voice_agent.harness.speech_assets import speech_wav
from voice_agent.settings import Settings, WebSettings, from_args

EXE = str(Path(sys.executable).with_name("voice-agent"))


# -- turn audio -----------------------------------------------------------------------------------


def _tone(freqs: list[float], rate: int, seconds: float = 1.0, level: float = 0.5) -> np.ndarray:
    """float samples in [-1, 1]: one column per frequency (one channel each)."""
    t = np.arange(round(rate * seconds)) / rate
    return np.stack([level * np.sin(2 * np.pi * f * t) for f in freqs], axis=1)


def _pcm_wav(path: Path, x: np.ndarray, rate: int, width: int) -> Path:
    """A PCM WAV written by the `wave` module: 8-bit unsigned, 16/24/32-bit signed."""
    if width == 1:
        data = np.round(x * 127 + 128).astype(np.uint8).tobytes()
    else:
        full = 2 ** (8 * width - 1) - 1
        ints = np.round(x * full).astype("<i4")
        if width == 3:  # the low three bytes of each little-endian int32
            data = ints.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
        else:
            data = (ints.astype("<i2") if width == 2 else ints).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)
    return path


def _float_wav(path: Path, x: np.ndarray, rate: int) -> Path:
    """A 32-bit IEEE float WAV (format tag 3, which the `wave` module cannot read or write)."""
    data = x.astype("<f4").tobytes()
    ch = x.shape[1]
    fmt = struct.pack("<HHIIHH", 3, ch, rate, rate * ch * 4, ch * 4, 32)
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
                     + b"fmt " + struct.pack("<I", len(fmt)) + fmt
                     + b"data" + struct.pack("<I", len(data)) + data)  # fmt: skip
    return path


def _level_at(samples: np.ndarray, rate: int, freq: float) -> float:
    """Amplitude (full scale 1) of the sine at `freq` in `samples`: their DFT at exactly `freq`."""
    x = samples.astype(np.float64) / 32767
    return float(2 * abs(np.dot(x, np.exp(-2j * np.pi * freq * np.arange(len(x)) / rate))) / len(x))


@pytest.mark.parametrize("kind, rate, width", [
    ("stereo", 48000, 2), ("mono", 16000, 1), ("mono", 44100, 3), ("mono", 8000, 4),
    ("stereo", 22050, "float"),
])  # fmt: skip
def test_turn_audio_in_any_format_becomes_mono_at_the_pipeline_rate(tmp_path, kind, rate, width):
    freqs = [440.0, 1000.0] if kind == "stereo" else [440.0]  # a different tone in each channel
    x = _tone(freqs, rate, seconds=1.0, level=0.5)
    path = tmp_path / f"turn-{kind}-{rate}-{width}.wav"
    _float_wav(path, x, rate) if width == "float" else _pcm_wav(path, x, rate, width)
    samples = load_turn_audio(path)
    assert samples.dtype == np.int16 and samples.ndim == 1
    # one second at 48 kHz (less the near-silent first and last samples trim_silence cuts)
    assert INPUT_RATE * 0.99 <= len(samples) <= INPUT_RATE * 1.01, len(samples)
    # each channel's tone at its frequency (so at the right rate) and level, halved by the mix of
    # two channels into one; and nothing else: the tones carry all of the signal's power
    levels = [_level_at(samples, INPUT_RATE, f) for f in freqs]
    assert levels == pytest.approx([0.5 / len(freqs)] * len(freqs), abs=0.02), levels
    power = np.mean((samples.astype(np.float64) / 32767) ** 2)
    assert power == pytest.approx(sum(a**2 / 2 for a in levels), rel=0.05), power


def test_a_text_file_is_not_audio(tmp_path):
    bad = tmp_path / "question.txt"
    bad.write_text("What time is it?\n")
    with pytest.raises(TurnAudioError, match="not audio") as e:
        load_turn_audio(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case, words", [
    ("missing", "no such file"), ("empty file", "empty"), ("no frames", "no audio samples"),
    ("silence", "silent"), ("directory", "directory"),
])  # fmt: skip
def test_unusable_turn_files_are_one_line_errors(tmp_path, case, words):
    path = tmp_path / "turn.wav"
    if case == "empty file":
        path.write_bytes(b"")
    elif case == "no frames":
        _pcm_wav(path, np.zeros((0, 1)), 16000, 2)
    elif case == "silence":
        _pcm_wav(path, np.zeros((16000, 1)), 16000, 2)
    elif case == "directory":
        path.mkdir()
    with pytest.raises(TurnAudioError, match=words) as e:
        load_turn_audio(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No agent setting from outside, offline, services (if any started) on ports of their own."""
    names = {f.metadata["env"] for cls in (Settings, WebSettings) for f in fields(cls)}
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith("LIVEKIT_")}
    env.update(HF_HUB_OFFLINE="1", VOICE_AGENT_OFFLINE="1",
               LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE="0", TTS_PORT=str(free_port()),
               VOICE_AGENT_CACHE=str(tmp_path / "cache"), LLM_PORT=str(free_port()),
               VOICE_AGENT_TEST_RUN=uuid.uuid4().hex)  # fmt: skip
    env.update(extra)
    return env


def _one_line_error(p, *words: str) -> str:
    out = f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.returncode not in (0, None), out
    assert "Traceback" not in p.stderr, out
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("voice-agent"), out
    for word in words:
        assert word in lines[0], out
    return lines[0]


def _no_service_started(env: dict[str, str]) -> None:
    cache = Path(env["VOICE_AGENT_CACHE"])
    logs = sorted(p.name for p in cache.glob("*.log")) if cache.is_dir() else []
    assert logs == [], f"services were started: {logs}"


def test_demo_checks_every_turn_file_before_anything_starts(tmp_path):
    good = _pcm_wav(tmp_path / "good.wav", _tone([440.0], 16000), 16000, 2)
    bad = tmp_path / "bad.txt"
    bad.write_text("not audio at all\n")
    env = _env(tmp_path)
    p = subprocess.run([EXE, "demo", str(good), str(bad)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    _one_line_error(p, "voice-agent: error:", str(bad), "not audio")
    _no_service_started(env)


def test_an_output_that_cannot_be_written_is_refused_first(tmp_path):
    (tmp_path / "file").write_text("")
    under_a_file = tmp_path / "file" / "reply.wav"
    for out, words in [(tmp_path, "is a directory"), (under_a_file, "not a directory")]:
        with pytest.raises(RuntimeError, match=words):
            check_output(out)
    check_output(tmp_path / "new" / "reply.wav")
    assert (tmp_path / "new").is_dir()


# -- settings: checked at parse time, wherever they come from ------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for cls in (Settings, WebSettings):
        for f in fields(cls):
            monkeypatch.delenv(f.metadata["env"], raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def _parse(*argv: str) -> Settings:
    return from_args(build_parser().parse_args(["demo", *argv]))


@pytest.mark.parametrize("flag, value, words", [
    ("--tts-variant", "3bit", "invalid choice: '3bit'"),
    ("--tts-variant", "./no-such-recipe.yaml", "no such recipe file"),
    ("--agent-load-threshold", "7", "(0, 1]"),
    ("--agent-load-threshold", "0", "(0, 1]"),
    ("--tts-protocol", "foo", "invalid choice: 'foo'"),
    ("--tts-model", "/no/such/dir", "no such directory"),
    ("--tts-model", "~/no/such/dir", "no such directory"),
    ("--stt-model", "nope", "not a faster-whisper model"),
    ("--stt-model", "../no/such/dir", "no such directory"),
    ("--tts-port", "70000", "not a port number"),
    ("--llm-max-tokens", "0", "> 0"),
    ("--tts-port", "eighty", "invalid int value: 'eighty'"),
])  # fmt: skip
def test_bad_flag_values_are_argparse_errors(clean_env, capsys, flag, value, words):
    with pytest.raises(SystemExit) as e:
        _parse(flag, value)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"voice-agent demo: error: argument {flag}: "), lines
    assert words in lines[0], lines


def test_good_flag_values_pass(clean_env, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("default_bits: 4\n")
    model = tmp_path / "model"
    model.mkdir()
    s = _parse("--tts-variant", "4bit", "--agent-load-threshold", "1",
               "--tts-protocol", "vllm-omni", "--tts-model", str(model),
               "--stt-model", "tiny.en")  # fmt: skip
    assert (s.tts_variant, s.agent_load_threshold, s.tts_protocol) == ("4bit", 1.0, "vllm-omni")
    assert (s.tts_model, s.stt_model) == (str(model), "tiny.en")
    assert _parse("--tts-variant", str(recipe)).tts_variant == str(recipe)
    assert _parse("--tts-model", "owner/some-model").tts_model == "owner/some-model"
    hub = "Systran/faster-whisper-base.en"
    for stt in ("bundled", "tiny.en-bundled", hub, str(model), "model"):
        assert _parse("--stt-model", stt).stt_model == stt  # "model": a directory in the cwd


def test_variant_names_are_not_checked_without_the_engine(clean_env, monkeypatch):
    """The engine is an optional extra (a remote TTS_URL needs none): then any name passes."""
    monkeypatch.setitem(sys.modules, "qwen3_tts_engine", None)  # import fails
    assert _parse("--tts-variant", "3bit").tts_variant == "3bit"


@pytest.mark.parametrize("where", ["environment", ".env"])
@pytest.mark.parametrize("name, value, words", [
    ("TTS_PROTOCOL", "foo", "invalid choice: 'foo'"),
    ("AGENT_LOAD_THRESHOLD", "7", "(0, 1]"),
    ("TTS_VARIANT", "3bit", "invalid choice: '3bit'"),
    ("STT_MODEL", "nope", "not a faster-whisper model"),
    ("TTS_MODEL", "./no/such/dir", "no such directory"),
])  # fmt: skip
def test_bad_environment_and_dotenv_values_name_the_variable(clean_env, tmp_path, where, name,
                                                              value, words):  # fmt: skip
    if where == "environment":
        clean_env.setenv(name, value)
    else:
        (tmp_path / ".env").write_text(f"{name}={value}\n")
    with pytest.raises(SystemExit) as e:
        _parse()
    message = str(e.value.code)
    assert message.startswith(f"voice-agent: error: {name} (set in ") and where in message, message
    assert words in message and "\n" not in message, message


def test_a_bad_flag_fails_before_anything_starts(tmp_path):
    env = _env(tmp_path, TTS_PROTOCOL="vllm-omni")
    p = subprocess.run([EXE, "demo", "--tts-variant", "3bit"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2
    _one_line_error(p, "voice-agent demo: error: argument --tts-variant: invalid choice: '3bit'")
    _no_service_started(env)


def test_a_bad_environment_value_fails_before_anything_starts(tmp_path):
    env = _env(tmp_path, TTS_PROTOCOL="foo")
    p = subprocess.run([EXE, "demo"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    _one_line_error(p, "voice-agent: error: TTS_PROTOCOL (set in the environment)", "'foo'")
    _no_service_started(env)


# -- a request that fails inside a turn ends it at once ------------------------------------------


@pytest.mark.slow
async def test_an_unknown_voice_ends_the_turn_at_once_with_the_engines_message(engine, caplog):
    llm = await ScriptedChatServer("Hello there.", use_tool=False).start()
    url = f"http://127.0.0.1:{engine.port}"
    settings = Settings(tts_url=url, llm_base_url=llm.url, llm_model="scripted", offline=True,
                        tts_voice="nobody")  # fmt: skip
    turn = load_turn_audio(speech_wav("Hello, can you hear me?", sample_rate=INPUT_RATE))
    caplog.set_level(logging.WARNING)
    try:
        # the turn's own timeout is far away: only the failure can end it within the bound
        with pytest.raises(TurnFailed) as e:
            await asyncio.wait_for(run_turns(settings, [turn], tts_url=url, llm_url=llm.url,
                                             turn_timeout=3600), 120)  # fmt: skip
    finally:
        await llm.stop()
    message = str(e.value)
    assert message.startswith("turn 1: the TTS failed: unknown voice 'nobody'"), message
    assert "voices:" in message and "ryan" in message and "\n" not in message
    assert llm.requests, "the turn reached the LLM, then the TTS"
    # LiveKit's traceback of the failure is not printed: the one line above says it
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith("livekit")]


@pytest.mark.slow
async def test_the_demo_checks_the_voice_once_the_engine_answers(engine):
    url = f"http://127.0.0.1:{engine.port}"
    for voice in ("ryan", "RYAN"):
        await asyncio.to_thread(check_voice, Settings(tts_voice=voice), url)
    # vLLM-Omni has no such list: not asked
    omni = Settings(tts_voice="nobody", tts_protocol="vllm-omni")
    await asyncio.to_thread(check_voice, omni, url)
    with pytest.raises(RuntimeError, match=r"no voice 'nobody' .*; voices: .*ryan") as e:
        await asyncio.to_thread(check_voice, Settings(tts_voice="nobody"), url)
    assert "\n" not in str(e.value)


@pytest.mark.slow
async def test_demo_with_an_unknown_voice_is_a_one_line_error(engine, tmp_path):
    """The real command against a running engine: it stops before the LLM and any turn."""
    turn = _pcm_wav(tmp_path / "turn.wav", _tone([440.0], 16000), 16000, 2)
    llm_url = f"http://127.0.0.1:{free_port()}/v1"  # nobody listens: never reached
    env = _env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        EXE, "demo", str(turn), "--tts-url", f"http://127.0.0.1:{engine.port}",
        "--llm-base-url", llm_url, "--tts-voice", "nobody", cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    p = subprocess.CompletedProcess([EXE], proc.returncode, out.decode(), err.decode())
    _one_line_error(p, "voice-agent: error:", "no voice 'nobody'", "ryan")
    _no_service_started(env)
