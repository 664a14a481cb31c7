"""One settings object for the voice agent: defaults < `.env` < environment < CLI flags.

`FIELDS` documents every setting (the README's configuration table is generated from it).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path


def _f(env: str, default, help: str):
    return field(default=default, metadata={"env": env, "help": help})


@dataclass
class Settings:
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
    tts_queue_capacity: int = _f("TTS_QUEUE_CAPACITY", 4, "engine requests (waiting or in flight) "
                                 "at which the worker reports full load to LiveKit")
    agent_load_threshold: float = _f("AGENT_LOAD_THRESHOLD", 0.7, "load (0..1: the larger of CPU, "
                                     "TTS queue, TTS memory) at which LiveKit sends no new jobs")
    agent_http_port: int = _f("AGENT_HTTP_PORT", 8081, "port of the worker's health and load "
                              "endpoints (`/`, `/worker`; 0: any free port)")
    worker_tag: str | None = _f("WORKER_TAG", None, "name of this worker, published as the agent "
                                "participant's `worker` attribute (unset: none)")
    offline: bool = _f("VOICE_AGENT_OFFLINE", False, "never use the network: bundled and generated "
                       "models only (also implied by HF_HUB_OFFLINE=1)")

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, dotenv: Path | None = Path(".env"),
             overrides: Mapping[str, object] | None = None) -> Settings:  # fmt: skip
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
        if values.get("HF_HUB_OFFLINE", "") in ("1", "true", "True"):
            kwargs["offline"] = True
        for key, value in (overrides or {}).items():
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per setting (e.g. --tts-url); unset flags fall back to the environment."""
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
        else:
            parser.add_argument(flag, default=None, help=f"{f.metadata['help']} [{f.metadata['env']}]",
                                type=_argtype(f))  # fmt: skip


def _argtype(f):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return int if kind.startswith("int") else float if kind.startswith("float") else str


def from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides={f.name: getattr(args, f.name, None) for f in fields(Settings)})


def markdown_table() -> str:
    rows = ["| variable | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(Settings):
        rows.append(f"| `{f.metadata['env']}` | `--{f.name.replace('_', '-')}` | "
                    f"`{f.default}` | {f.metadata['help']} |")  # fmt: skip
    return "\n".join(rows)
