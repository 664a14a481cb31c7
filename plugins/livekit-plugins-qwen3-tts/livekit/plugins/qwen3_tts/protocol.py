"""The client's half of the engine's streaming speech protocol (qwen3-tts-engine's
`qwen3_tts_engine/protocol.py` is the server's half; tests/plugins/qwen3_tts/test_wire_contract.py keeps the two
in step, without this plugin importing the engine).

`POST /v1/audio/speech` takes OpenAI's fields plus vLLM-Omni's Qwen3-TTS fields and streams
s16le mono PCM at 24 kHz, one HTTP chunk per 4-frame audio chunk; errors are OpenAI-style JSON
bodies (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SAMPLE_RATE = 24000
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # one 80 ms codec frame at 24 kHz
CHUNK_FRAMES = 4  # a 4-token chunk: 320 ms, 7680 samples
BYTES_PER_SAMPLE = 2  # s16le mono

# Response headers the engine sets; the client reads them.
HEADER_VARIANT = "X-Qwen3-TTS-Variant"
HEADER_MODEL = "X-Qwen3-TTS-Model"
HEADER_SAMPLE_RATE = "X-Sample-Rate"
HEADER_REQUEST_ID = "X-Request-Id"

LANGUAGES = (
    "auto", "chinese", "english", "japanese", "korean", "german",
    "french", "russian", "portuguese", "spanish", "italian",
)  # fmt: skip
_LANGUAGE_ALIASES = {
    "en": "english", "en-us": "english", "en-gb": "english", "eng": "english",
    "zh": "chinese", "zh-cn": "chinese", "cmn": "chinese", "mandarin": "chinese",
    "ja": "japanese", "jp": "japanese", "ko": "korean", "de": "german", "fr": "french",
    "ru": "russian", "pt": "portuguese", "pt-br": "portuguese", "es": "spanish",
    "it": "italian",
}  # fmt: skip


def normalize_language(value: str | None) -> str:
    """Full lower-case language name for Qwen3-TTS ("en" -> "english"); "auto" when unset."""
    if value is None or value == "":
        return "auto"
    key = value.strip().lower().replace("_", "-")
    key = _LANGUAGE_ALIASES.get(key, key)
    if key not in LANGUAGES:
        raise ValueError(
            f"unknown language {value!r}; use one of {', '.join(LANGUAGES)} or a code such as 'en'"
        )
    return key


def error_message(body: Any) -> str | None:
    """The message of an engine (or OpenAI-style) error body, if it is one."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        message = body["error"].get("message")
        return str(message) if message is not None else None
    return None


@dataclass(frozen=True)
class EngineLoad:
    """What a client weighs from `GET /v1/engine/status`: requests waiting or in flight on
    every handler, and the memory governor's pressure with its policy's band (when it runs)."""

    queue_depth: int
    memory_pressure: float | None = None
    upgrade_at: float | None = None  # at or below: memory is comfortable
    critical_at: float | None = None  # at or above: the engine is out of memory headroom

    @classmethod
    def from_status(cls, body: Mapping | None) -> EngineLoad:
        if not body:
            return cls(queue_depth=0)
        depth = sum(int(h.get("queue_depth") or 0) for h in body.get("handlers") or [])
        governor = body.get("governor") or {}
        pressure = (governor.get("pressure") or {}).get("pressure")
        policy = governor.get("policy") or {}
        if pressure is None or policy.get("upgrade_at") is None or policy.get("critical_at") is None:
            return cls(queue_depth=depth)
        return cls(queue_depth=depth, memory_pressure=float(pressure),
                   upgrade_at=float(policy["upgrade_at"]), critical_at=float(policy["critical_at"]))  # fmt: skip

    def memory_load(self) -> float:
        """0 at or below `upgrade_at`, 1 at `critical_at`, linear between; 0 without a governor."""
        if self.memory_pressure is None:
            return 0.0
        low, high = self.upgrade_at, self.critical_at
        return (self.memory_pressure - low) / max(1e-6, high - low)
