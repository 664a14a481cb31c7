"""Voice agent: Silero VAD -> faster-whisper -> LLM -> Qwen3-TTS on LiveKit."""
