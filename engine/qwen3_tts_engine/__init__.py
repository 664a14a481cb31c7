"""Qwen3-TTS engine on MLX: streaming speech over HTTP, quantized variants, a memory governor.

The public API, imported on first use (the server process never imports mlx; each handler's
worker process imports only what it runs):

    from qwen3_tts_engine import EngineConfig, ServerConfig, build_server
    server = build_server(EngineConfig("mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice-6bit"))

Handlers run mlx in spawned worker processes, which import the starting script again: keep the
code that starts an engine under `if __name__ == "__main__":`. Tiny random checkpoints for
tests and offline demos are in `qwen3_tts_engine.tiny_checkpoints` (not part of this API).

`qwen3-tts serve` runs the server; `livekit-plugins-qwen3-tts` is its LiveKit client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from qwen3_tts_engine.version import __version__

_EXPORTS = {
    "EngineConfig": "qwen3_tts_engine.config",
    "GovernorConfig": "qwen3_tts_engine.config",
    "build_server": "qwen3_tts_engine.config",
    "Engine": "qwen3_tts_engine.dispatch.engine",
    "Handler": "qwen3_tts_engine.dispatch.handler",
    "EngineServer": "qwen3_tts_engine.serving.app",
    "ServerConfig": "qwen3_tts_engine.serving.app",
    "serve_forever": "qwen3_tts_engine.serving.app",
    "Governor": "qwen3_tts_engine.governor.governor",
    "Policy": "qwen3_tts_engine.governor.policy",
    "variant_names": "qwen3_tts_engine.models.recipes",
}

if TYPE_CHECKING:
    from qwen3_tts_engine.config import EngineConfig, GovernorConfig, build_server
    from qwen3_tts_engine.dispatch.engine import Engine
    from qwen3_tts_engine.dispatch.handler import Handler
    from qwen3_tts_engine.governor.governor import Governor
    from qwen3_tts_engine.governor.policy import Policy
    from qwen3_tts_engine.models.recipes import variant_names
    from qwen3_tts_engine.serving.app import EngineServer, ServerConfig, serve_forever


def __getattr__(name: str):
    # lazily: `import qwen3_tts_engine` in a worker (or for its version) imports no server code
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qwen3_tts_engine' has no attribute {name!r}")


__all__ = [
    "Engine", "EngineConfig", "EngineServer", "Governor", "GovernorConfig", "Handler", "Policy",
    "ServerConfig", "build_server", "serve_forever", "variant_names", "__version__",
]  # fmt: skip
