"""Local services the agent starts when no URL is configured: the TTS engine and mlx_lm.server.

One engine per host: a worker that finds one of ours already answering on the port reuses it, so
every job process and every worker on a host shares it (`registry`: who uses a service, the
watchdog; `probes`: is the server on the port ours and healthy; `start` and `progress`: starting
one and waiting until it answers). Offline, generated tiny models stand in for the real ones
(`offline`, `tiny_llm`), and the output says loudly that their voice and answers are random.
"""

from voice_agent.services.engine import ensure_tts_engine
from voice_agent.services.llm import download_llm, ensure_llm
from voice_agent.services.offline import (
    RANDOM_LLM,
    RANDOM_TTS,
    hub_model_available,
    hub_reachable,
    resolve_offline,
)
from voice_agent.services.probes import PortInUseError
from voice_agent.services.progress import newest_progress
from voice_agent.services.registry import LocalService, cache_dir

__all__ = [
    "RANDOM_LLM", "RANDOM_TTS", "LocalService", "PortInUseError", "cache_dir", "download_llm",
    "ensure_llm", "ensure_tts_engine", "hub_model_available", "hub_reachable", "newest_progress",
    "resolve_offline",
]  # fmt: skip
