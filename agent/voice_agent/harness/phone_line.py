"""Telephone-line speech for tests and benchmarks: a WAV through what a phone call does to it.

A PSTN call carries 300-3400 Hz, sampled at 8 kHz and coded with G.711 µ-law (8 bits a sample);
LiveKit's SIP bridge decodes it and resamples to 48 kHz for the room. `phone_line_wav` does the
same with sox: band-pass, 8 kHz, µ-law, back to 16-bit PCM at the rate asked for. Cached next to
the source file's cache entry (same folder, `.phone-<rate>hz.wav`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from voice_agent.harness.speech_assets import require_tool, run_tool

TELEPHONE_BAND_HZ = (300, 3400)
LINE_RATE = 8000


def phone_line_wav(source: str | os.PathLike[str], *, sample_rate: int = 48000) -> Path:
    """Path to `source` (a WAV) as heard after a G.711 µ-law phone line, at `sample_rate`."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"no such WAV: {source}")
    out = source.with_name(f"{source.stem}.phone-{sample_rate}hz.wav")
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    sox = require_tool("sox")
    low, high = TELEPHONE_BAND_HZ
    with tempfile.TemporaryDirectory(dir=source.parent) as tmp:
        line = Path(tmp) / "line.wav"  # what travels: 8 kHz, 8-bit µ-law
        run_tool([sox, str(source), "-c", "1", "-e", "u-law", "-b", "8", str(line),
              "sinc", f"{low}-{high}", "rate", "-h", str(LINE_RATE)])  # fmt: skip
        decoded = Path(tmp) / "decoded.wav"
        run_tool([sox, str(line), "-e", "signed-integer", "-b", "16", str(decoded),
              "rate", "-h", str(sample_rate)])  # fmt: skip
        os.replace(decoded, out)
    return out
