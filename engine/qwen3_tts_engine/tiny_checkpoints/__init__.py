"""Tiny random Qwen3-TTS checkpoints in the real on-disk format: test assets, and the offline
demo's voice (random weights: its "voice" is noise).

`builder.py` writes them (mlx and mlx-audio, imported at its top). `default_tiny_checkpoint`
builds the default one once into the cache, in a child process, so that the process asking
for it (a server that serves it) never loads mlx itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from qwen3_tts_engine.models.checkpoints import cache_root

TINY_WARNING = (
    "NOTE: this is a generated tiny checkpoint with RANDOM weights: the 'voice' is noise. "
    "Pass --model with a real Qwen3-TTS checkpoint for speech."
)
BUILDER = "qwen3_tts_engine.tiny_checkpoints.builder"


def default_tiny_checkpoint(variant: str = "custom_voice") -> Path:
    """A tiny random checkpoint built once into the cache (for demos and offline runs); its
    utterances end by EOS after about one frame per text token, as a real model's end."""
    out = cache_root() / "tiny" / f"{variant}-seed0-eos-text"
    if not (out / "config.json").is_file():
        # written next to it and renamed into place: processes that ask at once never see half
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        subprocess.run([sys.executable, "-m", BUILDER, str(tmp), "--variant", variant,
                        "--seed", "0", "--eos", "text"], check=True, stdout=sys.stderr)  # fmt: skip
        try:
            os.replace(tmp, out)
        except OSError:  # another process put it there first
            if not (out / "config.json").is_file():
                raise
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out
