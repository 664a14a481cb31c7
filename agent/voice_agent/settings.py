"""One settings object for the voice agent: defaults < `.env` < environment < CLI flags.

`FIELDS` documents every setting (the README's configuration table is generated from it).
`WebSettings` is the same pattern for `voice-agent web` (the browser client's server).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Self


def _f(env: str, default, help: str, *, flag: bool = True):
    """A setting read from `env`; `flag=False`: no command-line flag (secrets stay out of `ps`)."""
    return field(default=default, metadata={"env": env, "help": help, "flag": flag})


class _EnvSettings:
    """`load()` for a settings dataclass whose fields carry `env`/`help` metadata (see `_f`)."""

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, dotenv: Path | None = Path(".env"),
             overrides: Mapping[str, object] | None = None) -> Self:  # fmt: skip
        """Read `.env` (if present), then the environment, then `overrides` (CLI flags)."""
        values: dict[str, str] = {}
        if dotenv is not None and dotenv.is_file():
            from dotenv import dotenv_values

            values.update({k: v for k, v in dotenv_values(dotenv).items() if v is not None})
        values.update(os.environ if env is None else env)
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            raw = values.get(f.metadata["env"])
            if raw is not None and raw != "":
                kwargs[f.name] = _parse(f, raw)
        offline_field = any(f.name == "offline" for f in fields(cls))
        if offline_field and values.get("HF_HUB_OFFLINE", "") in ("1", "true", "True"):
            kwargs["offline"] = True
        for key, value in (overrides or {}).items():
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)


@dataclass
class Settings(_EnvSettings):
    tts_url: str | None = _f("TTS_URL", None, "Qwen3-TTS engine or vLLM-Omni URL(s), comma-separated; "
                             "unset: start one local engine per host (shared by its workers)")
    tts_model: str = _f("TTS_MODEL", "mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice",
                        "model of the local engine (hub id or directory)")
    tts_variant: str | None = _f("TTS_VARIANT", None, "variant of the local engine (bf16, 8bit, "
                                 "6bit, 4bit, talker-mlp-w4, ...); unset: 6bit for mlx-community")
    tts_voice: str = _f("TTS_VOICE", "ryan", "speaker (CustomVoice models)")
    tts_language: str = _f("TTS_LANGUAGE", "en", "language of the agent's speech")
    tts_protocol: str = _f("TTS_PROTOCOL", "qwen3-tts", "qwen3-tts or vllm-omni")
    tts_port: int = _f("TTS_PORT", 8880, "port of the local engine")
    tts_max_new_tokens: int | None = _f("TTS_MAX_NEW_TOKENS", None, "frame cap per sentence "
                                        "(unset: derived from the text by the engine)")
    stt_model: str = _f("STT_MODEL", "base.en", "faster-whisper model; offline: the bundled tiny.en")
    stt_language: str = _f("STT_LANGUAGE", "en", "language of the user's speech")
    llm_base_url: str | None = _f("LLM_BASE_URL", None, "OpenAI-compatible server (vLLM, Ollama, "
                                  "llama.cpp, mlx-lm, OpenAI); unset: start mlx_lm.server locally")
    llm_model: str = _f("LLM_MODEL", "mlx-community/Qwen3-0.6B-4bit", "chat model name or local model")
    llm_api_key: str = _f("LLM_API_KEY", "not-needed", "API key of the LLM server")
    llm_port: int = _f("LLM_PORT", 8090, "port of the local mlx_lm.server")
    llm_max_tokens: int = _f("LLM_MAX_TOKENS", 256, "cap on the tokens of one reply")
    llm_temperature: float | None = _f("LLM_TEMPERATURE", None, "sampling temperature (unset: "
                                       "the server's default)")
    llm_timeout: float = _f("LLM_TIMEOUT", 120.0, "seconds; local prefill can be slow")
    instructions: str = _f("AGENT_INSTRUCTIONS", "You are a helpful voice assistant. Answer in one "
                           "or two short spoken sentences, without markdown.", "system prompt")
    metrics_port: int = _f("METRICS_PORT", 0, "Prometheus/health port of the agent (0: off)")
    tts_timeout: float = _f("TTS_TIMEOUT", 30.0, "seconds the agent waits for the TTS engine's "
                            "response and then for each next chunk before it fails over or gives "
                            "up (a shared engine's queue counts)")
    tts_queue_capacity: int = _f("TTS_QUEUE_CAPACITY", 4, "engine requests (waiting or in flight) "
                                 "at which the worker reports full load to LiveKit")
    agent_load_threshold: float = _f("AGENT_LOAD_THRESHOLD", 0.7, "load (0..1: the larger of CPU, "
                                     "TTS queue, TTS memory) at which LiveKit sends no new jobs")
    agent_load_cpu: bool = _f("AGENT_LOAD_CPU", True, "count this host's CPU in the load (off: "
                              "only the TTS engine's queue and memory, e.g. when the engine and "
                              "its CPU are on another host)")
    agent_http_port: int = _f("AGENT_HTTP_PORT", 8081, "port of the worker's health and load "
                              "endpoints (`/`, `/worker`; 0: any free port)")
    worker_tag: str | None = _f("WORKER_TAG", None, "name of this worker, published as the agent "
                                "participant's `worker` attribute (unset: none)")
    offline: bool = _f("VOICE_AGENT_OFFLINE", False, "never use the network: bundled and generated "
                       "models only (also implied by HF_HUB_OFFLINE=1)")


@dataclass
class WebSettings(_EnvSettings):
    """`voice-agent web`: the browser client and its token endpoint."""

    livekit_url: str | None = _f("LIVEKIT_URL", None, "LiveKit server the tokens are for (ws:// or wss://)")
    livekit_api_key: str | None = _f("LIVEKIT_API_KEY", None, "API key that signs the tokens")
    livekit_api_secret: str | None = _f("LIVEKIT_API_SECRET", None, "API secret that signs the tokens "
                                        "(environment or .env only; never sent to the page)",
                                        flag=False)  # fmt: skip
    web_livekit_url: str | None = _f("WEB_LIVEKIT_URL", None, "LiveKit URL as the browser must "
                                     "reach it, when that differs from LIVEKIT_URL")
    web_host: str = _f("WEB_HOST", "127.0.0.1", "address the web server binds (the token "
                       "endpoint has no login: expose it only behind your own auth)")
    web_port: int = _f("WEB_PORT", 8300, "port of the web server")
    web_token_ttl: int = _f("WEB_TOKEN_TTL", 600, "seconds a token stays valid for joining")
    web_client_js: str | None = _f("WEB_CLIENT_JS", None, "path of livekit-client.umd.js (unset: "
                                   "agent/voice_agent/web/node_modules, from npm ci)")


def _parse(f, raw: str):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
    except ValueError:
        raise SystemExit(f"voice-agent: {f.metadata['env']}={raw!r} is not a valid {kind}") from None
    return raw


def add_arguments(parser: argparse.ArgumentParser, cls: type = Settings) -> None:
    """One `--flag` per setting (e.g. --tts-url); unset flags fall back to the environment."""
    for f in fields(cls):
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{f.metadata['help']} [{f.metadata['env']}]")  # --x / --no-x
        else:
            parser.add_argument(flag, default=None, help=f"{f.metadata['help']} [{f.metadata['env']}]",
                                type=_argtype(f))  # fmt: skip


def _argtype(f):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return int if kind.startswith("int") else float if kind.startswith("float") else str


def from_args(args: argparse.Namespace, cls: type = Settings):
    return cls.load(overrides={f.name: getattr(args, f.name, None) for f in fields(cls)})


def markdown_table(cls: type = Settings) -> str:
    rows = ["| variable | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(cls):
        flag = f"`--{f.name.replace('_', '-')}`" if f.metadata.get("flag", True) else "–"
        rows.append(f"| `{f.metadata['env']}` | {flag} | `{f.default}` | {f.metadata['help']} |")
    return "\n".join(rows)
