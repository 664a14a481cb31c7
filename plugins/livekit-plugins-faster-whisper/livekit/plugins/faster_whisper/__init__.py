"""faster-whisper speech-to-text plugin for LiveKit Agents.

Runs a local Whisper model (CTranslate2) behind LiveKit's `stt.STT` interface: non-streaming by
default, or streaming with interim transcripts (`STT(streaming=True)`).
"""

from .models import (
    BUNDLED_MODEL_NAMES,
    ModelLoadError,
    WhisperModels,
    bundled_tiny_en_path,
    load_model,
    prewarm,
    resolve_model,
)
from .stt import STT, SpeechStream
from .version import __version__

__all__ = [
    "STT",
    "SpeechStream",
    "BUNDLED_MODEL_NAMES",
    "ModelLoadError",
    "WhisperModels",
    "bundled_tiny_en_path",
    "load_model",
    "prewarm",
    "resolve_model",
    "__version__",
]

from livekit.agents import Plugin

from .log import logger


class FasterWhisperPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__, logger)


Plugin.register_plugin(FasterWhisperPlugin())
