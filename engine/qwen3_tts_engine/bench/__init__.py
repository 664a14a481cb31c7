"""Benchmarks (`qwen3-tts bench engine|swap`): JSON on stdout, ratios within one run."""
