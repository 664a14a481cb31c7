"""`voice-agent bench soak`: callers keep calling a real livekit-server with two workers and one
shared TTS engine while faults are injected (`run`); the processes (`stack`), the callers
(`callers`), the LLM outage (`fault_proxy`) and the report's numbers (`report`)."""
