import logging

logger = logging.getLogger("qwen3_tts_engine")
