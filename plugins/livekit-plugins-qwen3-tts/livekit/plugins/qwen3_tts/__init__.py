"""Qwen3-TTS plugin for LiveKit Agents.

`TTS` is the streaming client (httpx; no mlx needed). The engine side — handlers, quantized
variants, the engine server — lives in `livekit.plugins.qwen3_tts.engine` (extra `[mlx]`).
"""

from .protocol import SAMPLE_RATE, SpeechRequest
from .tts import TTS, ChunkedStream, SentenceReport, SynthesizeStream
from .version import __version__

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream", "SentenceReport", "SpeechRequest",
           "SAMPLE_RATE", "__version__"]

from livekit.agents import Plugin

from .log import logger


class Qwen3TTSPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__, logger)


Plugin.register_plugin(Qwen3TTSPlugin())
