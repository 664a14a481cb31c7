"""The `qwen3-tts` command line as a user runs it (subprocesses, real engine on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from tests.support.engine_process import EngineProcess

pytestmark = pytest.mark.slow
EXE = str(Path(sys.executable).with_name("qwen3-tts"))


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=600, env=os.environ)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def test_tiny_checkpoint_command(tmp_path):
    out = tmp_path / "ckpt"
    p = run("tiny-checkpoint", str(out), "--kind", "base", "--bits", "4", "--seed", "3")
    assert "wrote base tiny checkpoint" in p.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tts_model_type"] == "base" and cfg["quantization"]["bits"] == 4
    assert (out / "speech_tokenizer" / "config.json").is_file()


def test_say_in_process_json(tiny_checkpoint, tmp_path):
    wav = tmp_path / "say.wav"
    p = run("say", "Hello there.", "--model", str(tiny_checkpoint("custom_voice")), "--voice", "ryan",
            "--max-new-tokens", "6", "--first-chunk-frames", "2", "--seed", "1", "--out", str(wav),
            "--json")  # fmt: skip
    report = json.loads(p.stdout)
    assert report["variant"] == "bf16" and report["sample_rate"] == 24000
    assert [c["frames"] for c in report["chunks"]] == [2, 4]
    assert [c["samples"] for c in report["chunks"]] == [3840, 7680]
    assert 0 < report["first_audio_s"] <= report["total_s"] and report["rtf"] > 0
    assert "model of type" not in p.stderr  # transformers' warning on every load, filtered
    with wave.open(str(wav)) as w:
        assert w.getnframes() == 6 * 1920


def test_say_through_server_and_bad_input(tiny_checkpoint):
    engine = EngineProcess(tiny_checkpoint("custom_voice")).start()
    try:
        p = run("say", "Through the server.", "--server", engine.url, "--max-new-tokens", "4",
                "--json")  # fmt: skip
        report = json.loads(p.stdout)
        assert report["variant"] == "bf16" and sum(c["samples"] for c in report["chunks"]) == 7680
        bad = run("say", "x", "--server", engine.url, "--voice", "nobody", check=False)
        assert bad.returncode != 0 and "unknown voice" in bad.stderr + bad.stdout
        lang = run("say", "x", "--server", engine.url, "--language", "elvish", check=False)
        assert lang.returncode == 2 and "unknown language" in lang.stderr
    finally:
        engine.stop()


def test_demo_json(tmp_path):
    out = tmp_path / "demo.wav"
    p = run("demo", "--json", "--out", str(out), "--max-new-tokens", "6")
    report = json.loads(p.stdout)
    assert "RANDOM weights" in p.stderr
    assert report["samples"] == 6 * 1920 and report["variant"] == "bf16"
    assert 0 < report["first_audio_s"] < report["total_s"]
    assert out.is_file()


def test_unknown_variant_is_a_clear_error(tiny_checkpoint):
    p = run("say", "x", "--model", str(tiny_checkpoint("custom_voice")), "--variant", "3bits",
            check=False)  # fmt: skip
    assert p.returncode == 2 and "valid variants" in p.stderr and "Traceback" not in p.stderr
