"""`ServerConfig`: what the engine server's routes read (limits, keys, the socket's bounds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qwen3_tts_engine.protocol import (
    DEFAULT_TEXT_PACE,
    DEFAULT_TEXT_START_TOKENS,
    OPENAI_VOICE_ALIASES,
    Limits,
)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8880
    api_key: str | None = None  # bearer token for /v1/*; from QWEN3_TTS_API_KEY
    operator_key: str | None = None  # alone may change the variant; from QWEN3_TTS_OPERATOR_KEY
    # serve a non-loopback host without an API key (refused otherwise)
    insecure_no_auth: bool = False
    ref_audio_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 12 * 1024 * 1024
    max_queue: int = 32
    retry_after_s: int = 2
    # streamed text (docs/engine-api.md): tokens before the first frame, tokens per frame at most
    text_start_tokens: int = DEFAULT_TEXT_START_TOKENS
    text_pace: float = DEFAULT_TEXT_PACE
    # a WebSocket client that stops reading is dropped (its utterance cancelled) when this much
    # audio waits for it (1 MiB: ~11 s of audio, in the kernel and again in the transport), or
    # when one frame takes longer than the timeout to go out
    ws_send_buffer_bytes: int = 1 << 20
    ws_send_timeout_s: float = 30.0
    # flow control: a stream takes no more audio from the engine while this many seconds of it
    # wait unsent for its client (the transport's buffer and the kernel's send queue); the
    # engine then pauses it (docs/engine-api.md, "Limits")
    ws_ahead_s: float = 3.0
    # WebSocket sessions (docs/engine-api.md, "Limits"): at most max_sessions open (more: 429 at
    # the upgrade); a session's first text within ws_first_text_timeout_s of its upgrade, then a
    # message within ws_idle_timeout_s while its text is open, or it ends with a 408 `error`
    # event; a ping every ws_heartbeat_s (no pong within half of it: the peer is gone)
    max_sessions: int = 256
    ws_first_text_timeout_s: float = 30.0
    ws_idle_timeout_s: float = 60.0
    ws_heartbeat_s: float = 20.0
    # messages (text, binary, ping, pong) one utterance may take: a flood of empty appends or
    # pings ends the session with a 429 `error` event; text itself is bounded by max_input_chars
    ws_max_messages: int = 10_000
    # a socket with no utterance in progress (before its first, or between two) is closed (1000)
    # after this long: a warm socket lasts a call, not forever
    ws_keepalive_timeout_s: float = 300.0
    # sentences one socket may have waiting for their turn (the hosted protocol's server_commit,
    # vLLM-Omni's sentence splitting): past it, sentence ends are not cut and the text joins the
    # last one waiting (bounded by max_input_chars), so the backlog is bounded
    ws_max_pending: int = 64
    # voice names a request may use for the model's voices (OpenAI's by default)
    voice_aliases: dict[str, str] = field(default_factory=lambda: dict(OPENAI_VOICE_ALIASES))
