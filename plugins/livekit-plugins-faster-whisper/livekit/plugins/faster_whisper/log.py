import logging

logger = logging.getLogger("livekit.plugins.faster_whisper")
