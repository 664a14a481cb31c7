"""Settings: defaults < `.env` < environment < command-line flags, and the documented tables
(docs/configuration.md)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from voice_agent.cli import build_parser
from voice_agent.settings import KeeperSettings, Settings, WebSettings, from_args, markdown_table

# the page that holds the generated settings tables
CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No setting in the environment and a cwd of our own (so no `.env` but the test's)."""
    for cls in (Settings, WebSettings):
        for f in fields(cls):
            monkeypatch.delenv(f.metadata["env"], raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def _cli(*argv: str):
    """The settings `voice-agent` builds for these arguments (what `cli.main` does)."""
    args = build_parser().parse_args(list(argv))
    return from_args(args, WebSettings if args.command == "web" else Settings)


def test_each_level_overrides_the_one_below(clean_env, tmp_path):
    (tmp_path / ".env").write_text(
        "TTS_VOICE=from-dotenv\n"  # .env only
        "TTS_PORT=1111\n"  # .env < environment
        "LLM_PORT=1111\nLLM_MAX_TOKENS=11\n"  # .env < environment < flag
        "VOICE_AGENT_OFFLINE=0\n"
    )
    clean_env.setenv("TTS_PORT", "2222")
    clean_env.setenv("LLM_PORT", "2222")
    clean_env.setenv("LLM_MAX_TOKENS", "22")
    clean_env.setenv("LLM_TIMEOUT", "2.5")  # environment only
    s = _cli("demo", "--llm-port", "3333", "--llm-max-tokens", "33", "--offline")
    defaults = Settings()
    assert s.stt_language == defaults.stt_language == "en"  # nowhere set: the default
    assert s.tts_voice == "from-dotenv" != defaults.tts_voice
    assert s.tts_port == 2222
    assert s.llm_timeout == 2.5
    assert (s.llm_port, s.llm_max_tokens) == (3333, 33)
    assert s.offline is True  # a flag over `VOICE_AGENT_OFFLINE=0` in .env


def test_unset_flags_do_not_override(clean_env, tmp_path):
    (tmp_path / ".env").write_text("LLM_PORT=1111\n")
    assert _cli("demo").llm_port == 1111
    clean_env.setenv("LLM_PORT", "2222")
    s = _cli("demo")
    assert s.llm_port == 2222 and s.offline is False and s.tts_url is None


def test_web_settings_follow_the_same_order(clean_env, tmp_path):
    (tmp_path / ".env").write_text("LIVEKIT_API_SECRET=dotenv-secret\nWEB_PORT=1111\n"
                                   "WEB_TOKEN_TTL=11\nLIVEKIT_URL=ws://dotenv:7880\n")  # fmt: skip
    clean_env.setenv("WEB_PORT", "2222")
    clean_env.setenv("WEB_TOKEN_TTL", "22")
    s = _cli("web", "--web-token-ttl", "33")
    assert s.web_host == "127.0.0.1"  # default
    assert (s.livekit_api_secret, s.livekit_url) == ("dotenv-secret", "ws://dotenv:7880")
    assert (s.web_port, s.web_token_ttl) == (2222, 33)


def test_a_secret_has_no_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["web", "--livekit-api-secret", "x"])


def test_bad_values_are_one_line_errors(clean_env):
    clean_env.setenv("TTS_PORT", "eighty")
    with pytest.raises(SystemExit, match=r"TTS_PORT='eighty' is not a valid int"):
        _cli("demo")


@pytest.mark.parametrize("cls", [Settings, WebSettings, KeeperSettings])
def test_readme_tables_are_the_generated_ones(cls):
    """Regenerate each table from the dataclass metadata: a setting added, renamed or changed
    without updating docs/configuration.md fails here (`voice-agent settings` prints the agent's
    table)."""
    readme = CONFIG_DOC.read_text()
    table = markdown_table(cls).splitlines()
    # the page's table that starts with the same header line and the same first row
    found = []
    for m in re.finditer(r"^( *)" + re.escape(table[0]) + r"\n", readme, re.M):
        indent, lines = m.group(1), []
        for line in readme[m.start() :].splitlines():
            if not line.startswith(indent + "|"):
                break
            lines.append(line[len(indent) :])
        if len(lines) > 2 and lines[2].split("|")[1] == table[2].split("|")[1]:
            found.append(lines)
    assert len(found) == 1, (
        f"expected one table for {cls.__name__} in {CONFIG_DOC.name}, found {len(found)}"
    )
    assert found[0] == table, (
        "docs/configuration.md's table differs from markdown_table(): regenerate it"
    )
