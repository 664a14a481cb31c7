"""Checkpoints: variants, quantization recipes, loading (quantize on load), footprints."""
