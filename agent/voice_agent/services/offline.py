"""Working without the model hub: whether it can be reached, and what stands in for models that
cannot be downloaded (generated tiny models; the output says loudly that they are random)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from pathlib import Path

from voice_agent.settings import Settings

logger = logging.getLogger("voice_agent")
RANDOM_TTS = "the TTS is a generated tiny checkpoint with RANDOM weights: its voice is noise"
RANDOM_LLM = "the LLM is a generated tiny model with RANDOM weights: its answers are gibberish"


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether model downloads can work at all (a TCP connection to the hub)."""
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_offline(settings: Settings) -> Settings:
    """Settings with `offline` set when the hub cannot be reached, saying so once."""
    if settings.offline or hub_reachable():
        return settings
    logger.warning("no network to the model hub: using bundled and generated models")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return replace(settings, offline=True)


def hub_model_available(model: str, offline: bool) -> bool:
    """True if `model` is a local directory, or a hub id we may download."""
    return Path(model).expanduser().is_dir() or not offline
