"""The engine side of the plugin (needs the `[mlx]` extra): handlers that run Qwen3-TTS with
mlx-audio in worker processes, quantized variants and recipes, and the streaming engine server.
"""
