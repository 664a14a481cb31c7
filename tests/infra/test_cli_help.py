"""`--help` of every command (qwen3-tts's and voice-agent's subcommands, walked from their
parsers) explains every option and shows its default: the docs send users there for both."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from qwen3_tts_engine.cli import build_parser as engine_parser
from voice_agent.cli import build_parser as agent_parser
from voice_agent.settings import KeeperSettings, Settings, WebSettings

SETTINGS = {f.name for cls in (Settings, WebSettings, KeeperSettings) for f in fields(cls)}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _options(make):
    parser = make()
    for command, p in _commands(parser, (parser.prog,)):
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                yield command, p, action


ALL = [(c, "/".join(a.option_strings) or a.dest, p, a)
       for make in (engine_parser, agent_parser) for c, p, a in _options(make)]  # fmt: skip


@pytest.mark.parametrize("command, option, parser, action", ALL,
                         ids=[f"{c}:{o}" for c, o, _, _ in ALL])  # fmt: skip
def test_every_option_has_help_and_shows_its_default(command, option, parser, action):
    assert action.help and action.help != argparse.SUPPRESS, f"{command} {option}: no help"
    text = parser._get_formatter()._expand_help(action)  # as --help prints it
    has_default = action.default not in (None, False, argparse.SUPPRESS)
    a_setting = command.startswith("voice-agent") and action.dest in SETTINGS  # default: None
    if has_default or a_setting:
        assert "default" in text.lower(), f"{command} {option}: no default in {text!r}"
    if (
        has_default
        and isinstance(action.default, int | float | str)
        and "%(default)" in (parser.formatter_class(parser.prog)._get_help_string(action))
    ):
        assert str(action.default) in text


def test_serve_help_shows_the_defaults_the_docs_left_unwritten():
    exe = Path(sys.executable).with_name("qwen3-tts")
    out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    flat = " ".join(out.split())
    for option, default in (("--port", "8880"), ("--host", "127.0.0.1"), ("--max-queue", "32"),
                            ("--max-input-chars", "4000")):  # fmt: skip
        start = flat.index(f"{option} {option.lstrip('-').upper().replace('-', '_')} ")
        assert f"(default: {default})" in flat[start : start + 300], option
    assert "--ref-audio-dir" in flat and "ref_audio may name (default: none" in flat
