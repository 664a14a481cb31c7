"""Quantization quality: bootstrap statistics, audio metrics and reports (candidate vs bf16)."""
