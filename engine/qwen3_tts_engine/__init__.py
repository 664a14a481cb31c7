"""Qwen3-TTS engine on MLX: streaming speech over HTTP, quantized variants, a memory governor.

The public API, imported on first use (a spawned handler worker imports only what it runs):

    from qwen3_tts_engine import Engine, EngineServer, Handler, ServerConfig

Handlers run mlx in spawned worker processes, which import the starting script again: keep the
code that starts an engine under `if __name__ == "__main__":`.

`qwen3-tts serve` runs the server; `livekit-plugins-qwen3-tts` is its LiveKit client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

_EXPORTS = {
    "Engine": "qwen3_tts_engine.runtime.engine",
    "Handler": "qwen3_tts_engine.runtime.handler",
    "EngineServer": "qwen3_tts_engine.serving.app",
    "ServerConfig": "qwen3_tts_engine.serving.app",
    "serve_forever": "qwen3_tts_engine.serving.app",
    "Governor": "qwen3_tts_engine.governor.governor",
    "Policy": "qwen3_tts_engine.governor.policy",
    "default_tiny_checkpoint": "qwen3_tts_engine.testing.tiny_checkpoint",
    "write_tiny_checkpoint": "qwen3_tts_engine.testing.tiny_checkpoint",
    "write_tokenizer": "qwen3_tts_engine.testing.tiny_checkpoint",
    "variant_names": "qwen3_tts_engine.models.recipes",
}

if TYPE_CHECKING:
    from .governor.governor import Governor
    from .governor.policy import Policy
    from .models.recipes import variant_names
    from .runtime.engine import Engine
    from .runtime.handler import Handler
    from .serving.app import EngineServer, ServerConfig, serve_forever
    from .testing.tiny_checkpoint import (
        default_tiny_checkpoint,
        write_tiny_checkpoint,
        write_tokenizer,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qwen3_tts_engine' has no attribute {name!r}")


__all__ = [
    "Engine", "EngineServer", "Governor", "Handler", "Policy", "ServerConfig",
    "default_tiny_checkpoint", "serve_forever", "write_tiny_checkpoint", "write_tokenizer",
    "variant_names", "__version__",
]  # fmt: skip
