"""Where a request's `ref_audio` may come from: base64 data, or a file under one allowed folder.

Nothing else: no other paths (traversal and symlinks out of the folder are refused), no URLs.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from qwen3_tts_engine.protocol import RequestError

_AUDIO_MAGIC = (b"RIFF", b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")


def _looks_like_audio(data: bytes) -> bool:
    return data.startswith(_AUDIO_MAGIC)


def resolve_ref_audio(value: str | None, allowed_dir: Path | None, max_bytes: int) -> bytes | None:
    """The reference audio's bytes, or RequestError (param `ref_audio`) saying why not."""
    if value is None or value == "":
        return None
    lowered = value[:16].lower()
    if "://" in value[:32] or lowered.startswith("file:"):
        raise RequestError(
            "ref_audio URLs are not fetched; send base64 audio data", param="ref_audio"
        )

    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise RequestError("ref_audio data URI must be base64-encoded", param="ref_audio")
        return _decode(payload, max_bytes)

    # "." is not in the base64 alphabet: a value with one is a file name ("voices/me.wav").
    if "." in value:
        return _read_allowed(value, allowed_dir, max_bytes)
    return _decode(value, max_bytes)


def _decode(payload: str, max_bytes: int) -> bytes:
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(
            "ref_audio is neither valid base64 nor an allowed file", param="ref_audio"
        ) from None
    if len(data) > max_bytes:
        raise RequestError(
            f"ref_audio is larger than {max_bytes} bytes", param="ref_audio", status=413
        )
    if not _looks_like_audio(data):
        raise RequestError("ref_audio is not WAV, FLAC, Ogg or MP3 data", param="ref_audio")
    return data


def _read_allowed(name: str, allowed_dir: Path | None, max_bytes: int) -> bytes:
    if allowed_dir is None:
        raise RequestError(
            "ref_audio file names are not accepted by this server (no --ref-audio-dir); "
            "send base64 audio data",
            param="ref_audio",
        )
    root = allowed_dir.resolve()
    if "\x00" in name:
        raise RequestError("ref_audio file name is invalid", param="ref_audio")
    target = (root / name).resolve()
    if not target.is_relative_to(root):
        raise RequestError("ref_audio must name a file inside the allowed folder", param="ref_audio",
                           status=403)  # fmt: skip
    if not target.is_file():
        raise RequestError(f"ref_audio file {name!r} does not exist", param="ref_audio", status=404)
    if target.stat().st_size > max_bytes:
        raise RequestError(
            f"ref_audio is larger than {max_bytes} bytes", param="ref_audio", status=413
        )
    data = target.read_bytes()
    if not _looks_like_audio(data):
        raise RequestError("ref_audio file is not WAV, FLAC, Ogg or MP3 data", param="ref_audio")
    return data
