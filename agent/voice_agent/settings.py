"""One settings object for the voice agent: defaults < `.env` < environment < CLI flags.

`FIELDS` documents every setting (docs/configuration.md's table is generated from it).
`WebSettings` is the same pattern for `voice-agent web` (the browser client's server).
A field's `check` refuses bad values in one place, wherever they come from: a flag (argparse's
one-line error), the environment or `.env` (an error that names the variable).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Self

from dotenv import dotenv_values


def _f(env: str, default, help: str, *, flag: bool = True,
       check: Callable[[object], str | None] | None = None):  # fmt: skip
    """A setting read from `env`; `flag=False`: no command-line flag (secrets stay out of `ps`);
    `check(value)`: what is wrong with a value (one line), or None."""
    return field(default=default, metadata={"env": env, "help": help, "flag": flag, "check": check})


# -- checks: each returns what is wrong with a value, or None --------------------------------------


def _choice(*names: str):
    def check(v) -> str | None:
        return None if v in names else f"invalid choice: {v!r} (choose from {_quoted(names)})"

    return check


def _quoted(names) -> str:
    return ", ".join(map(repr, names))


def _port(v) -> str | None:
    return None if 0 <= v <= 65535 else f"{v} is not a port number (0-65535)"


def _positive(v) -> str | None:
    return None if v > 0 else f"must be > 0, got {v}"


def _not_negative(v) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v}"


def _whisper_context(v) -> str | None:
    return None if 0 < v <= 30 else f"must be in (0, 30] seconds, got {v}"


def _fraction(v) -> str | None:
    return None if 0 < v <= 1 else f"must be in (0, 1], got {v}"


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _local_path(v: str) -> bool:
    """A value written as a path on this machine, not as a hub id."""
    return v in (".", "..") or v.startswith(("/", "./", "~", ".."))


def _model_dir(v: str) -> str | None:
    """A local path must be an existing directory; anything else, a directory or a hub id."""
    path = Path(v).expanduser()
    if _local_path(v) and not path.is_dir():
        return f"{v!r} is not a directory" if path.exists() else f"no such directory: {v!r}"
    if path.is_dir() or HUB_ID.fullmatch(v):
        return None
    return f"{v!r} is neither a model directory nor a hub id (owner/name)"


def _tts_variant(v: str) -> str | None:
    """A variant of the engine (`qwen3_tts_engine.variant_names()`) or a recipe file."""
    if _local_path(v) or v.endswith((".yaml", ".yml", ".json")):
        return None if Path(v).expanduser().is_file() else f"no such recipe file: {v!r}"
    try:
        # optional extra: the engine (`voice-agent[local]`); the only engine import outside
        # voice_agent.services and voice_agent.lab (the `agent-engine-users` import contract)
        from qwen3_tts_engine import variant_names
    except ImportError:  # the engine is an optional extra (a remote TTS_URL needs none)
        return None
    names = variant_names()
    if v not in names:
        return f"invalid choice: {v!r} (choose from {_quoted(names)}, or a recipe .yaml)"
    return None


def _stt_model(v: str) -> str | None:
    """A faster-whisper size, the bundled tiny.en, a model directory or a hub id."""
    if v in ("bundled", "tiny.en-bundled"):
        return None
    if _local_path(v) or Path(v).expanduser().is_dir() or HUB_ID.fullmatch(v):
        return _model_dir(v)
    try:
        # CLI start-up time: faster-whisper brings ctranslate2 (~0.5 s), for this check only
        from faster_whisper.utils import available_models
    except ImportError:  # cannot tell: faster-whisper says so when it loads
        return None
    sizes = list(available_models())
    return None if v in sizes else (f"{v!r} is not a faster-whisper model: use a size "
                                    f"({', '.join(sizes)}), bundled, a model directory or a hub "
                                    "id (owner/name)")  # fmt: skip


DTMF_DIGITS = "0123456789*#"
DTMF_ACTIONS = ("transfer", "hangup")


def parse_dtmf_actions(spec: str) -> dict[str, str]:
    """`"0=transfer,9=hangup"` -> {"0": "transfer", "9": "hangup"} (ValueError on a bad entry)."""
    actions: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        digit, sep, action = (p.strip() for p in entry.partition("="))
        if not sep or len(digit) != 1 or digit not in DTMF_DIGITS:
            raise ValueError(f"{entry!r} is not DIGIT=ACTION (a digit 0-9, * or #)")
        if action not in DTMF_ACTIONS:
            raise ValueError(
                f"{entry!r}: unknown action {action!r} (choose from {', '.join(DTMF_ACTIONS)})"
            )
        if digit in actions:
            raise ValueError(f"digit {digit!r} is given two actions")
        actions[digit] = action
    return actions


def _dtmf_actions(v: str) -> str | None:
    try:
        parse_dtmf_actions(v)
    except ValueError as e:
        return str(e)
    return None


def _transfer_target(v: str) -> str | None:
    """A `tel:` or `sip:` URI, or a number in E.164 form (+ and digits)."""
    number = v.removeprefix("tel:")
    if v.startswith("sip:") or (
        number.startswith("+") and number[1:].isdigit() and len(number) > 4
    ):
        return None
    return f"{v!r} is not a phone number (+15550100, tel:+15550100) or a sip: URI"


def _probability(v) -> str | None:
    return None if 0 < v < 1 else f"must be between 0 and 1, got {v}"


class _EnvSettings:
    """`load()` for a settings dataclass whose fields carry `env`/`help` metadata (see `_f`)."""

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, dotenv: Path | None = Path(".env"),
             overrides: Mapping[str, object] | None = None) -> Self:  # fmt: skip
        """Read `.env` (if present), then the environment, then `overrides` (CLI flags)."""
        values: dict[str, str] = {}
        if dotenv is not None and dotenv.is_file():
            values.update({k: v for k, v in dotenv_values(dotenv).items() if v is not None})
        environ = os.environ if env is None else env
        values.update(environ)
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            name = f.metadata["env"]
            raw = values.get(name)
            if raw is not None and raw != "":
                source = "the environment" if name in environ else str(dotenv)
                kwargs[f.name] = _parse(f, raw, source)
        offline_field = any(f.name == "offline" for f in fields(cls))
        if offline_field and values.get("HF_HUB_OFFLINE", "") in ("1", "true", "True"):
            kwargs["offline"] = True
        for key, value in (overrides or {}).items():
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)


@dataclass
class Settings(_EnvSettings):
    tts_url: str | None = _f(
        "TTS_URL",
        None,
        "Qwen3-TTS engine or vLLM-Omni URL(s), comma-separated; "
        "unset: start one local engine per host (shared by its workers)",
    )
    tts_model: str = _f(
        "TTS_MODEL",
        "mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice",
        "model of the local engine (hub id or directory)",
        check=_model_dir,
    )
    tts_variant: str | None = _f(
        "TTS_VARIANT",
        None,
        "variant of the local engine (bf16, 8bit, "
        "6bit, 4bit, talker-mlp-w4, ...); unset: 6bit for mlx-community",
        check=_tts_variant,
    )
    tts_voice: str = _f("TTS_VOICE", "ryan", "speaker (CustomVoice models)")
    tts_language: str = _f("TTS_LANGUAGE", "en", "language of the agent's speech")
    tts_protocol: str = _f(
        "TTS_PROTOCOL",
        "qwen3-tts",
        "qwen3-tts or vllm-omni",
        check=_choice("qwen3-tts", "vllm-omni"),
    )
    tts_port: int = _f("TTS_PORT", 8880, "port of the local engine", check=_port)
    tts_max_new_tokens: int | None = _f(
        "TTS_MAX_NEW_TOKENS",
        None,
        "frame cap per sentence (unset: derived from the text by the engine)",
        check=_positive,
    )
    stt_model: str = _f(
        "STT_MODEL",
        "base.en",
        "faster-whisper model; offline: the bundled tiny.en",
        check=_stt_model,
    )
    stt_language: str = _f("STT_LANGUAGE", "en", "language of the user's speech")
    stt_streaming: bool = _f(
        "STT_STREAMING",
        True,
        "transcribe while the user speaks, so the final "
        "transcript is ready soon after the end of speech (off: the whole "
        "utterance once it has ended)",
    )
    stt_encoder_context: float = _f(
        "STT_ENCODER_CONTEXT",
        15.0,
        "seconds of audio whisper's encoder "
        "sees in a streaming pass (30: whisper's full context; shorter "
        "is faster, 15 transcribes as 30 on the bench's speech)",
        check=_whisper_context,
    )
    stt_final_silence: float = _f(
        "STT_FINAL_SILENCE",
        0.3,
        "seconds of silence after which the "
        "streaming STT ends an utterance it has heard in full, before "
        "the VAD's end of speech (LiveKit's end-of-turn check sees final "
        "transcripts only)",
        check=_positive,
    )
    llm_base_url: str | None = _f(
        "LLM_BASE_URL",
        None,
        "OpenAI-compatible server (vLLM, Ollama, "
        "llama.cpp, mlx-lm, OpenAI); unset: start mlx_lm.server locally",
    )
    llm_model: str = _f(
        "LLM_MODEL", "mlx-community/Qwen3-0.6B-4bit", "chat model name or local model"
    )
    llm_api_key: str = _f("LLM_API_KEY", "not-needed", "API key of the LLM server")
    llm_port: int = _f("LLM_PORT", 8090, "port of the local mlx_lm.server", check=_port)
    llm_max_tokens: int = _f(
        "LLM_MAX_TOKENS", 256, "cap on the tokens of one reply", check=_positive
    )
    llm_temperature: float | None = _f(
        "LLM_TEMPERATURE",
        None,
        "sampling temperature (unset: the server's default)",
        check=_not_negative,
    )
    llm_timeout: float = _f(
        "LLM_TIMEOUT", 120.0, "seconds; local prefill can be slow", check=_positive
    )
    # Turn-taking: when the agent decides the user has finished (docs/agent.md: Turn-taking).
    vad_min_silence: float = _f(
        "VAD_MIN_SILENCE",
        0.35,
        "seconds of silence before Silero reports the end of speech (LiveKit's default: 0.55)",
        check=_positive,
    )
    endpointing_min_delay: float = _f(
        "ENDPOINTING_MIN_DELAY",
        0.5,
        "seconds after the last speech before a finished-sounding turn is committed",
        check=_not_negative,
    )
    endpointing_max_delay: float = _f(
        "ENDPOINTING_MAX_DELAY",
        2.5,
        "seconds the agent waits after speech that sounds unfinished (TURN_DETECTOR)",
        check=_positive,
    )
    turn_detector: str = _f(
        "TURN_DETECTOR",
        "rule",
        "end-of-turn check on the transcript: rule "
        "(a trailing 'and', 'for', comma... waits ENDPOINTING_MAX_DELAY), livekit "
        "(livekit-plugins-turn-detector's model, when installed with its model "
        "files), none",
        check=_choice("rule", "livekit", "none"),
    )
    tts_text_input: str = _f(
        "TTS_TEXT_INPUT",
        "auto",
        "how the reply's text reaches the TTS "
        "engine: stream (as the LLM writes it, over the engine's WebSocket), "
        "sentences (a request per sentence and first clause), auto (stream "
        "where the engine's status says it can: ours, not vLLM-Omni)",
        check=_choice("auto", "stream", "sentences"),
    )
    tts_first_clause_words: int = _f(
        "TTS_FIRST_CLAUSE_WORDS",
        3,
        "sentence input: a reply's first "
        "request to the TTS is its first clause once it has this many "
        "words (a comma, dash...); 0: whole sentences",
        check=_not_negative,
    )
    tts_first_clause_chunk_frames: int = _f(
        "TTS_FIRST_CLAUSE_CHUNK_FRAMES",
        2,
        "codec frames in the "
        "first audio chunk of a reply's first request (1, 2 or "
        "4; later requests: 4); streamed input: of each reply",
        check=_choice(1, 2, 4),
    )
    preemptive_generation: bool = _f(
        "PREEMPTIVE_GENERATION",
        True,
        "start the LLM on the final "
        "transcript before the turn is committed (LiveKit's; redone "
        "if the transcript changes)",
    )
    preemptive_tts: bool = _f(
        "PREEMPTIVE_TTS",
        False,
        "with PREEMPTIVE_GENERATION, also start the "
        "reply's speech before the turn is committed (LiveKit's; its audio "
        "plays only if the turn goes on to commit)",
    )
    instructions: str = _f(
        "AGENT_INSTRUCTIONS",
        "You are a helpful voice assistant. Answer in one "
        "or two short spoken sentences, without markdown.",
        "system prompt",
    )
    metrics_port: int = _f(
        "METRICS_PORT",
        0,
        "Prometheus port of the agent (`/metrics`; 0: off): "
        "in start/dev mode LiveKit's worker endpoint, carrying every job "
        "process's turns (prometheus-client multiprocess mode)",
        check=_port,
    )
    tts_timeout: float = _f(
        "TTS_TIMEOUT",
        30.0,
        "seconds the agent waits for the TTS engine's "
        "response and then for each next chunk before it fails over or gives "
        "up (a shared engine's queue counts)",
        check=_positive,
    )
    tts_hold_after: float = _f(
        "TTS_HOLD_AFTER",
        1.0,
        "seconds a reply may wait while every TTS engine is full or down before the agent says "
        "'One moment, please.' (cached in its voice, or a bundled clip), keeps trying, then "
        "apologises (0: off, the reply fails silently)",
        check=_not_negative,
    )
    tts_give_up_after: float = _f(
        "TTS_GIVE_UP_AFTER",
        10.0,
        "seconds after 'One moment, please.' the agent waits for an engine before it apologises "
        "instead of the reply (it apologises sooner if the TTS's retries are spent)",
        check=_positive,
    )
    stt_timeout: float = _f(
        "STT_TIMEOUT",
        30.0,
        "seconds a transcription may take before the "
        "turn gives up on it (LiveKit's default, 10 s, is short for a local "
        "model on a busy CPU)",
        check=_positive,
    )
    tts_queue_capacity: int = _f(
        "TTS_QUEUE_CAPACITY",
        4,
        "engine requests (waiting or in flight) at which the worker reports full load to LiveKit",
        check=_positive,
    )
    agent_load_threshold: float = _f(
        "AGENT_LOAD_THRESHOLD",
        0.7,
        "load (0..1: the larger of CPU, TTS queue, TTS memory) at which LiveKit sends no new jobs",
        check=_fraction,
    )
    agent_load_cpu: bool = _f(
        "AGENT_LOAD_CPU",
        True,
        "count this host's CPU in the load (off: "
        "only the TTS engine's queue and memory, e.g. when the engine and "
        "its CPU are on another host)",
    )
    agent_http_host: str = _f(
        "AGENT_HTTP_HOST",
        "127.0.0.1",
        "address the worker's health, load "
        "and metrics endpoints bind (0.0.0.0 in a container, for probes "
        "and Prometheus)",
    )
    agent_http_port: int = _f(
        "AGENT_HTTP_PORT",
        8081,
        "port of the worker's health and load endpoints (`/`, `/worker`; 0: any free port)",
        check=_port,
    )
    worker_tag: str | None = _f(
        "WORKER_TAG",
        None,
        "name of this worker, published as the agent "
        "participant's `worker` attribute (unset: none)",
    )
    # Phone calls: callers that are SIP participants (docs/telephony.md).
    phone_greeting: str = _f(
        "PHONE_GREETING",
        "Hello! You are speaking with a voice assistant. How can I help you?",
        "what the agent says when a phone caller "
        "joins ({caller_number}: the caller's number, digit by digit; empty: "
        "nothing)",
    )
    phone_vad_activation: float = _f(
        "PHONE_VAD_ACTIVATION",
        0.5,
        "Silero's speech threshold for phone callers (raise it on noisy lines)",
        check=_probability,
    )
    phone_vad_min_silence: float = _f(
        "PHONE_VAD_MIN_SILENCE", 0.35, "VAD_MIN_SILENCE for phone callers", check=_positive
    )
    dtmf_actions: str = _f(
        "DTMF_ACTIONS",
        "",
        "keypad digits with an action, e.g. "
        "'0=transfer,9=hangup'; every other digit reaches the LLM as text ('The "
        "caller pressed 1')",
        check=_dtmf_actions,
    )
    transfer_to: str | None = _f(
        "TRANSFER_TO",
        None,
        "where `transfer_call` and the transfer "
        "digit send a phone caller (+15550100, tel:..., sip:...; unset: "
        "no transfers)",
        check=_transfer_target,
    )
    keeper_url: str | None = _f(
        "KEEPER_URL",
        None,
        "the call keeper (`voice-agent keeper`): each "
        "job sends it heartbeats, so a call whose agent is lost gets a new "
        "one (unset: no heartbeats)",
    )
    resume_greeting: str = _f(
        "RESUME_GREETING",
        "Sorry, we were cut off for a moment. I am back, please go on.",
        "what an agent says when it takes over a call whose "
        "agent was lost (the conversation so far comes from the room)",
    )
    offline: bool = _f(
        "VOICE_AGENT_OFFLINE",
        False,
        "never use the network: bundled and generated "
        "models only (also implied by HF_HUB_OFFLINE=1)",
    )


@dataclass
class WebSettings(_EnvSettings):
    """`voice-agent web`: the browser client and its token endpoint."""

    livekit_url: str | None = _f(
        "LIVEKIT_URL", None, "LiveKit server the tokens are for (ws:// or wss://)"
    )
    livekit_api_key: str | None = _f("LIVEKIT_API_KEY", None, "API key that signs the tokens")
    livekit_api_secret: str | None = _f("LIVEKIT_API_SECRET", None, "API secret that signs the tokens "
                                        "(environment or .env only; never sent to the page)",
                                        flag=False)  # fmt: skip
    web_livekit_url: str | None = _f(
        "WEB_LIVEKIT_URL",
        None,
        "LiveKit URL as the browser must reach it, when that differs from LIVEKIT_URL",
    )
    web_host: str = _f(
        "WEB_HOST",
        "127.0.0.1",
        "address the web server binds (the token "
        "endpoint has no login: expose it only behind your own auth)",
    )
    web_port: int = _f("WEB_PORT", 8300, "port of the web server", check=_port)
    web_token_ttl: int = _f(
        "WEB_TOKEN_TTL",
        600,
        "seconds a token stays valid for joining (keep "
        "it short: a leaked token joins its room until then)",
        check=_positive,
    )
    web_token_rate: int = _f(
        "WEB_TOKEN_RATE",
        10,
        "token requests per minute from one client "
        "address, refused or not (over it: 429 with Retry-After; 0: no limit)",
        check=_not_negative,
    )
    web_allow_room_names: bool = _f(
        "WEB_ALLOW_ROOM_NAMES",
        False,
        "let visitors name the room "
        "they join (off: 403 for a named room; every visit gets a "
        "new unguessable room)",
    )
    web_allow_occupied_rooms: bool = _f(
        "WEB_ALLOW_OCCUPIED_ROOMS",
        False,
        "with "
        "WEB_ALLOW_ROOM_NAMES: also grant a named room that "
        "already has a person in it (off: 409; the LiveKit "
        "server is asked, 503 when it cannot be)",
    )
    web_client_js: str | None = _f(
        "WEB_CLIENT_JS",
        None,
        "path of livekit-client.umd.js (unset: agent/voice_agent/web/node_modules, from npm ci)",
    )


@dataclass
class KeeperSettings(_EnvSettings):
    """`voice-agent keeper`: calls get their agent back (LiveKit webhooks, job heartbeats)."""

    keeper_host: str = _f(
        "KEEPER_HOST",
        "127.0.0.1",
        "address the keeper binds (LiveKit's webhooks and the workers' heartbeats must reach it)",
    )
    keeper_port: int = _f("KEEPER_PORT", 8400, "port of the keeper", check=_port)
    keeper_heartbeat_timeout: float = _f(
        "KEEPER_HEARTBEAT_TIMEOUT",
        3.0,
        "seconds without a job's heartbeat before its call counts as lost (jobs beat every second)",
        check=_positive,
    )
    keeper_dispatch_wait: float = _f(
        "KEEPER_DISPATCH_WAIT",
        5.0,
        "seconds a room with a caller "
        "may wait for an agent before the keeper dispatches one "
        "(and again every as many seconds until one joins)",
        check=_positive,
    )
    agent_name: str = _f(
        "AGENT_NAME",
        "",
        "agent name of the dispatches (empty: the workers without a name, as this project's are)",
    )
    livekit_url: str | None = _f("LIVEKIT_URL", None, "LiveKit server whose rooms are kept")
    livekit_api_key: str | None = _f(
        "LIVEKIT_API_KEY", None, "API key (verifies webhooks and heartbeats, signs dispatches)"
    )
    livekit_api_secret: str | None = _f(
        "LIVEKIT_API_SECRET", None, "API secret (environment or .env only)", flag=False
    )


def _convert(f, raw: str):
    """`raw` as the field's type (ValueError if it is not one)."""
    kind = _kind(f)
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("bool"):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(raw)
        return raw.lower() in ("1", "true", "yes")
    return raw


def _kind(f) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def problem(f, value) -> str | None:
    """What is wrong with a value of field `f` (its `check`), or None."""
    check = f.metadata.get("check")
    return None if value is None or check is None else check(value)


def _parse(f, raw: str, source: str = "the environment"):
    """A value from the environment or .env: a bad one exits with one line naming the variable."""
    env = f.metadata["env"]
    try:
        value = _convert(f, raw)
    except ValueError:
        kind = _kind(f).split(" ")[0]
        raise SystemExit(
            f"voice-agent: error: {env}={raw!r} is not a valid {kind} (set in {source})"
        ) from None
    if (wrong := problem(f, value)) is not None:
        raise SystemExit(f"voice-agent: error: {env} (set in {source}): {wrong}")
    return value


def add_arguments(parser: argparse.ArgumentParser, cls: type = Settings) -> None:
    """One `--flag` per setting (e.g. --tts-url); unset flags fall back to the environment.
    A bad value is argparse's one-line error (`... error: argument --tts-protocol: ...`)."""
    for f in fields(cls):
        if not f.metadata.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        # the flag's own default is None (unset: the environment, then the setting's default)
        shown = "unset" if f.default in (None, "") else f.default
        help = f"{f.metadata['help']} [{f.metadata['env']}; default: {shown}]".replace("%", "%%")
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help,
            )  # --x / --no-x
        else:
            parser.add_argument(flag, default=None, help=help, type=_argtype(f))  # fmt: skip
    if type(parser).error is argparse.ArgumentParser.error:  # not customized by the caller
        parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")


def _argtype(f):
    """argparse's `type`: the field's type, then its check."""
    kind = _kind(f)
    name = "int" if kind.startswith("int") else "float" if kind.startswith("float") else "str"

    def parse(raw: str):
        try:
            value = _convert(f, raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {name} value: {raw!r}") from None
        if (wrong := problem(f, value)) is not None:
            raise argparse.ArgumentTypeError(wrong)
        return value

    parse.__name__ = name
    return parse


def from_args(args: argparse.Namespace, cls: type = Settings):
    return cls.load(overrides={f.name: getattr(args, f.name, None) for f in fields(cls)})


def markdown_table(cls: type = Settings) -> str:
    rows = ["| variable | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(cls):
        flag = f"`--{f.name.replace('_', '-')}`" if f.metadata.get("flag", True) else "–"
        rows.append(f"| `{f.metadata['env']}` | {flag} | `{f.default}` | {f.metadata['help']} |")
    return "\n".join(rows)
