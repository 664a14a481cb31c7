"""Qwen3-TTS plugin for LiveKit Agents.

`TTS` is a streaming client (httpx; no mlx) of a Qwen3-TTS engine server: `qwen3-tts serve`
from the `qwen3-tts-engine` package, or vLLM-Omni (`protocol="vllm-omni"`).
"""

from .clauses import FirstClauseTokenizer
from .models import TaskTypes, TTSLanguages, TTSModels, TTSVoices, Variants
from .protocol import SAMPLE_RATE, EngineLoad
from .tts import TTS, ChunkedStream, SentenceReport, SynthesizeStream
from .version import __version__

__all__ = [
    "TTS",
    "ChunkedStream",
    "SynthesizeStream",
    "SentenceReport",
    "EngineLoad",
    "FirstClauseTokenizer",
    "SAMPLE_RATE",
    "TTSModels",
    "TTSVoices",
    "TTSLanguages",
    "TaskTypes",
    "Variants",
    "__version__",
]

from livekit.agents import Plugin

from .log import logger


class Qwen3TTSPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__, logger)


Plugin.register_plugin(Qwen3TTSPlugin())
