"""Benchmarks: `voice-agent bench` (turn-taking and TTS under LLM contention: `bench`,
`turn_bench`) and `voice-agent bench soak` (calls under injected faults: `soak`)."""
