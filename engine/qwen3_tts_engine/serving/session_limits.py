"""The bounds of every speech socket, whatever its dialect: one `SessionLimits`, read from the
`ServerConfig` as a socket opens, and the one rule for a close frame's reason.

docs/engine-api.md's socket limits table names each field here (tests/infra/test_docs.py holds
the table to `LIMITS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_tts_engine.serving.server_config import ServerConfig

# A close frame carries at most 125 bytes: the 2-byte code and a reason of 123 bytes of UTF-8.
MAX_CLOSE_REASON_BYTES = 123


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int  # sockets open at once (more: 429 at the upgrade)
    max_messages: int  # client messages (and pings) per utterance (more: 429)
    max_text_chars: int  # text per utterance, and so per message (more: 413)
    max_pending: int  # sentences waiting their turn; past it they join the last one waiting
    first_text_s: float  # an utterance's first text after its start (else 408)
    idle_s: float  # a message while text is open, from the client's last message (else 408)
    keepalive_s: float  # with nothing in progress, from the last message or utterance (1000)
    send_buffer_bytes: int  # audio waiting for a client that stopped reading: it is dropped
    send_timeout_s: float  # one frame's send at most: it is dropped
    ahead_s: float  # seconds of audio a stream runs ahead of what its client read (it pauses)
    heartbeat_s: float  # a ping this often; no pong within half of it: the peer is gone

    @classmethod
    def of(cls, config: ServerConfig) -> SessionLimits:
        return cls(**{name: getattr(config, field) if "." not in field
                      else getattr(config.limits, field.split(".")[1])
                      for name, field in LIMITS.items()})  # fmt: skip


# SessionLimits field -> the ServerConfig field it is read from (the docs' table names both)
LIMITS = {
    "max_sessions": "max_sessions",
    "max_messages": "ws_max_messages",
    "max_text_chars": "limits.max_input_chars",
    "max_pending": "ws_max_pending",
    "first_text_s": "ws_first_text_timeout_s",
    "idle_s": "ws_idle_timeout_s",
    "keepalive_s": "ws_keepalive_timeout_s",
    "send_buffer_bytes": "ws_send_buffer_bytes",
    "send_timeout_s": "ws_send_timeout_s",
    "ahead_s": "ws_ahead_s",
    "heartbeat_s": "ws_heartbeat_s",
}


def close_reason(text: str) -> bytes:
    """`text` as a close frame's reason: UTF-8, cut to MAX_CLOSE_REASON_BYTES on a character
    boundary (a reason cut inside a character is invalid UTF-8: the peer answers 1002)."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= MAX_CLOSE_REASON_BYTES:
        return data
    return data[:MAX_CLOSE_REASON_BYTES].decode("utf-8", errors="ignore").encode()
