"""Qwen3-TTS plugin for LiveKit Agents.

`TTS` is a streaming client (httpx; no mlx) of a Qwen3-TTS engine server: `qwen3-tts serve`
from the `qwen3-tts-engine` package, or vLLM-Omni (`protocol="vllm-omni"`). `fleet` is the fleet
contract (an engine's load, the engines behind a URL, free slots, a fleet's load) for callers
that place work by it, such as an agent worker's load.
"""

from . import fleet
from .clauses import FirstClauseTokenizer
from .fleet import Capacity, Target
from .models import TaskTypes, TTSLanguages, TTSModels, TTSVoices, Variants
from .protocol import SAMPLE_RATE
from .tts import TTS, ChunkedStream, Ending, SentenceReport, SynthesizeStream
from .version import __version__

__all__ = [
    "TTS",
    "ChunkedStream",
    "SynthesizeStream",
    "SentenceReport",
    "Ending",
    "fleet",
    "Capacity",
    "Target",
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
