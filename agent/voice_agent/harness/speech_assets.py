"""Real speech for tests and demos: espeak-ng WAVs at a chosen sample rate, cached on disk.

On a Mac without espeak-ng, macOS's own `say` speaks instead (`choose_speech_tool`). Also small
helpers to read audio into int16 samples (`read_audio`: any file FFmpeg decodes, via
PyAV; `read_wav`: 16-bit PCM WAV) and to pad speech with silence.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import av
import numpy as np
from livekit import rtc

CACHE_ENV = "VOICE_AGENT_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/qwen3-voice-agent")
INSTALL_HINT = "apt-get install espeak-ng sox"
MACOS_INSTALL_HINT = "brew install espeak-ng sox"
SPEECH_TOOL_ENV = "VOICE_AGENT_SPEECH_TOOL"  # espeak-ng | say; unset: choose_speech_tool decides
SPEECH_TOOLS = ("espeak-ng", "say")
# espeak-ng's English voice names -> voices every macOS has; other names go to `say -v` as given
SAY_VOICES = {"en": "Samantha", "en-us": "Samantha", "en-gb": "Daniel"}


class SpeechToolMissing(RuntimeError):
    """espeak-ng (or sox, for resampling), or macOS's `say`, is not installed."""


def choose_speech_tool(requested: str | None = None, *, platform: str = sys.platform,
                       which=shutil.which) -> str:  # fmt: skip
    """The program that speaks: `requested`, else `$VOICE_AGENT_SPEECH_TOOL`, else espeak-ng where
    it is installed (the tests' expected transcripts were tuned on its voice), else `say` on
    macOS, where it always is. Elsewhere espeak-ng (its absence is reported when it is run)."""
    requested = requested or os.environ.get(SPEECH_TOOL_ENV) or None
    if requested is not None:
        if requested not in SPEECH_TOOLS:
            raise ValueError(f"unknown speech tool {requested!r}; one of {', '.join(SPEECH_TOOLS)}")
        return requested
    if which("espeak-ng") is None and platform == "darwin" and which("say") is not None:
        return "say"
    return "espeak-ng"


class AudioFileError(ValueError):
    """A file that cannot be read as audio: missing, not audio, or without any samples."""


def speech_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir` if given, else `$VOICE_AGENT_CACHE/speech`, else ~/.cache/qwen3-voice-agent/speech."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else DEFAULT_CACHE_ROOT).expanduser() / "speech"


def speech_wav(
    text: str,
    *,
    sample_rate: int = 16000,
    voice: str = "en-us",
    words_per_minute: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    tool: str | None = None,
) -> Path:
    """Path to a mono 16-bit WAV of `text` spoken at `sample_rate` by espeak-ng, or by macOS's
    `say` (`tool`; see `choose_speech_tool`). `voice` is espeak-ng's voice; `say` maps the English
    ones (`SAY_VOICES`) and takes any other as one of its own names.

    Generated once per (text, voice, rate, speed, tool) and reused from the cache afterwards.
    """
    if not text.strip():
        raise ValueError("text must not be empty")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")

    tool = choose_speech_tool(tool)
    directory = speech_cache_dir(cache_dir)
    path = directory / _cache_name(text, voice, sample_rate, words_per_minute, tool)
    if path.is_file():
        return path

    directory.mkdir(parents=True, exist_ok=True)
    if tool == "say":
        return _say_wav(text, path, voice, sample_rate, words_per_minute)
    espeak = require_tool("espeak-ng")
    # write under a temporary name, then rename: concurrent callers never see half a file
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        raw = Path(tmp) / "espeak.wav"
        cmd = [espeak, "-v", voice, "-w", str(raw)]
        if words_per_minute is not None:
            cmd += ["-s", str(words_per_minute)]
        run_tool([*cmd, "--", text])

        with wave.open(str(raw), "rb") as w:
            espeak_rate = w.getframerate()
        if espeak_rate == sample_rate:
            out = raw
        else:
            out = Path(tmp) / "resampled.wav"
            sox = require_tool("sox")
            # -h: high-quality resampler; -b 16 -c 1: keep mono int16
            run_tool(
                [sox, str(raw), "-b", "16", "-c", "1", str(out), "rate", "-h", str(sample_rate)]
            )
        os.replace(out, path)
    return path


def _say_wav(text: str, path: Path, voice: str, sample_rate: int,
             words_per_minute: int | None) -> Path:  # fmt: skip
    """macOS's `say` writes 16-bit PCM at `sample_rate` itself (no sox); the text goes through a
    file, so a text that starts with a dash is never read as an option."""
    say = require_tool("say")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        text_file, raw = Path(tmp) / "text.txt", Path(tmp) / "say.wav"
        text_file.write_text(text, encoding="utf-8")
        cmd = [say, "-o", str(raw), "--file-format=WAVE", f"--data-format=LEI16@{sample_rate}",
               "-v", SAY_VOICES.get(voice, voice)]  # fmt: skip
        if words_per_minute is not None:
            cmd += ["-r", str(words_per_minute)]
        run_tool([*cmd, "-f", str(text_file)])
        out = _plain_pcm_wav(raw, sample_rate, Path(tmp) / "plain.wav")
        os.replace(out, path)
    return path


def _plain_pcm_wav(path: Path, sample_rate: int, out: Path) -> Path:
    """`path` when it is a mono 16-bit PCM WAV at `sample_rate` that `wave` reads, else `out`
    holding its audio as one (a WAVE_FORMAT_EXTENSIBLE header, more channels, another rate)."""
    try:
        with wave.open(str(path), "rb") as w:
            if (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, sample_rate):
                return path
    except (wave.Error, EOFError):
        pass
    try:
        samples = read_audio(path, sample_rate)
    except AudioFileError as e:
        raise RuntimeError(f"say wrote no usable audio: {e}") from None
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return out


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """(int16 samples, sample rate) of a 16-bit PCM WAV; multi-channel files come back (n, ch)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * w.getsampwidth()}-bit")
        channels, rate = w.getnchannels(), w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
    if channels > 1:
        samples = samples.reshape(-1, channels)
    return samples, rate


def read_audio(path: str | os.PathLike[str], sample_rate: int) -> np.ndarray:
    """int16 mono samples at `sample_rate` of any audio file FFmpeg decodes (WAV of any sample
    format and channel count, FLAC, MP3, Ogg, a video's first audio track...): channels are
    averaged, then resampled. Raises `AudioFileError` with a one-line message."""
    path = Path(path)
    if not path.exists():
        raise AudioFileError(f"{path}: no such file")
    if path.is_dir():
        raise AudioFileError(f"{path} is a directory, not an audio file")
    if path.stat().st_size == 0:
        raise AudioFileError(f"{path} is empty (0 bytes), not a WAV or other audio file")
    pcm = _read_pcm_wav(path, sample_rate)
    if pcm is not None:
        if not len(pcm):
            raise AudioFileError(f"{path} holds no audio samples")
        return pcm
    try:
        with av.open(str(path)) as container:
            kind = container.format.long_name
            stream = next((s for s in container.streams if s.type == "audio"), None)
            parts = _decode_mono(container, stream, sample_rate) if stream else []
    except av.FFmpegError as e:
        raise AudioFileError(f"{path} is not audio (not a WAV or any format FFmpeg decodes): "
                             f"{e.strerror or type(e).__name__}") from None  # fmt: skip
    except (OSError, ValueError) as e:  # unreadable, or a stream whose format changes midway
        raise AudioFileError(f"{path} cannot be read as audio: {e}") from None
    if stream is None:
        raise AudioFileError(f"{path} is not audio: no audio stream in it (read as {kind})")
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if not len(samples):
        raise AudioFileError(f"{path} holds no audio samples")
    return np.clip(np.round(samples * 32767), -32768, 32767).astype(np.int16)


def _read_pcm_wav(path: Path, sample_rate: int) -> np.ndarray | None:
    """An integer-PCM WAV (8/16/24/32-bit, any channels and rate) read with `wave` and resampled
    by LiveKit's resampler, as the pipeline's own audio is; None for anything else (PyAV reads
    it). The common case stays off FFmpeg: a `voice-agent bench` process that had decoded its
    turn with PyAV sometimes aborted at exit ("terminate called without an active exception")."""
    try:
        with wave.open(str(path), "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError):
        return None
    if width == 1:  # unsigned 8-bit
        x = (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
    elif width == 3:  # 24-bit little-endian: widen to 32 bits
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        x = (b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8)
             | (b[:, 2].astype(np.int8).astype(np.int32) << 16)) / 8388608.0  # fmt: skip
    elif width in (2, 4):
        x = np.frombuffer(raw, f"<i{width}").astype(np.float64) / float(2 ** (8 * width - 1))
    else:
        return None
    x = x[: len(x) - len(x) % channels].reshape(-1, channels).mean(axis=1) if channels > 1 else x
    samples = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
    if rate == sample_rate or not len(samples):
        return samples
    resampler = rtc.AudioResampler(rate, sample_rate, quality=rtc.AudioResamplerQuality.HIGH)
    frames = resampler.push(rtc.AudioFrame(samples.tobytes(), rate, 1, len(samples)))
    frames += resampler.flush()
    return np.concatenate([np.frombuffer(bytes(f.data), np.int16) for f in frames])


def _decode_mono(container, stream, sample_rate: int) -> list[np.ndarray]:
    """float mono blocks of `stream` at `sample_rate`: resampled, then its channels averaged."""
    resampler = av.AudioResampler(format="flt", layout=stream.layout, rate=sample_rate)
    parts = []
    for frame in itertools.chain(container.decode(stream), [None]):  # None flushes the resampler
        for out in resampler.resample(frame):
            parts.append(out.to_ndarray().reshape(-1, len(out.layout.channels)).mean(axis=1))
    return parts


def pad_silence(
    samples: np.ndarray, sample_rate: int, *, before: float = 0.0, after: float = 0.0
) -> np.ndarray:
    """`samples` with `before`/`after` seconds of digital silence added (same dtype)."""
    if before < 0 or after < 0:
        raise ValueError("padding durations must be >= 0")
    pad = [(round(before * sample_rate), round(after * sample_rate))]
    pad += [(0, 0)] * (samples.ndim - 1)
    return np.pad(samples, pad)


def speech_samples(text: str, *, sample_rate: int = 16000, **kwargs) -> np.ndarray:
    """int16 samples of `text` spoken at `sample_rate` (see `speech_wav` for the options)."""
    samples, rate = read_wav(speech_wav(text, sample_rate=sample_rate, **kwargs))
    assert rate == sample_rate, (rate, sample_rate)
    return samples


def _cache_name(text: str, voice: str, sample_rate: int, words_per_minute: int | None,
                tool: str = "espeak-ng") -> str:  # fmt: skip
    # espeak-ng's names are those from before `say` existed here: caches made then stay valid
    key = [text, voice, sample_rate, words_per_minute] + ([tool] if tool != "espeak-ng" else [])
    digest = hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:16]
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "speech"
    voice_slug = re.sub(
        r"[^A-Za-z0-9+.-]+", "_", voice if tool == "espeak-ng" else f"{tool}-{voice}"
    )
    return f"{slug}.{voice_slug}.{sample_rate}hz.{digest}.wav"


def require_tool(name: str) -> str:
    """The path of the program `name`; SpeechToolMissing, with how to install it, if there is none."""
    path = shutil.which(name)
    if path is None:
        if name == "say":
            raise SpeechToolMissing(f"say is not installed (it is part of macOS); elsewhere use "
                                    f"espeak-ng: {INSTALL_HINT}")  # fmt: skip
        hint = MACOS_INSTALL_HINT if sys.platform == "darwin" else INSTALL_HINT
        raise SpeechToolMissing(f"{name} is not installed; install it with: {hint}")
    return path


def run_tool(cmd: list[str]) -> None:
    """Run a speech or audio tool; RuntimeError with its stderr when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()}"
        )
