"""Test assets: tiny random Qwen3-TTS checkpoints that mlx-audio loads (no download)."""

from .tiny_checkpoint import (
    TINY_WARNING,
    default_tiny_checkpoint,
    write_tiny_checkpoint,
    write_tokenizer,
)

__all__ = ["TINY_WARNING", "default_tiny_checkpoint", "write_tiny_checkpoint", "write_tokenizer"]
