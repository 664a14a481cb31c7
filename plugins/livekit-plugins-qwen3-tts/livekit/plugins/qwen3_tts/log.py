import logging

logger = logging.getLogger("livekit.plugins.qwen3_tts")
