"""The session core's pure parts (serving/session_core.py, session_limits.py): the states and the
commands each allows, the bounded backlog, the unit cuts, the limits read from the config, and
the close reason cut to 123 bytes of UTF-8 on a character boundary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qwen3_tts_engine.dispatch.text_input import TextInput
from qwen3_tts_engine.protocol import Limits, RequestError
from qwen3_tts_engine.serving.server_config import ServerConfig
from qwen3_tts_engine.serving.session_core import (
    ALLOWED,
    MOVES,
    Backlog,
    Command,
    State,
    allowed,
    check_piece,
    split_parts,
)
from qwen3_tts_engine.serving.session_limits import (
    LIMITS,
    MAX_CLOSE_REASON_BYTES,
    SessionLimits,
    close_reason,
)


class Item:
    def __init__(self) -> None:
        self.text = TextInput()


def test_each_state_allows_its_commands_and_moves_forward_only():
    assert allowed(None, Command.CONFIGURE) and not allowed(None, Command.APPEND)
    assert allowed(State.TEXT_OPEN, Command.APPEND) and not allowed(
        State.TEXT_OPEN, Command.CONFIGURE
    )
    assert not allowed(State.FLUSHING, Command.APPEND) and allowed(State.FLUSHING, Command.CANCEL)
    assert all(Command.CLOSE in ALLOWED[s] for s in ALLOWED)
    for over in (State.DONE, State.CANCELLED):
        assert MOVES[over] == set() and allowed(over, Command.CONFIGURE)
    assert State.WAITING not in set().union(*MOVES.values())  # nothing goes back to waiting


def test_units_are_cut_at_their_ends_by_granularity():
    assert split_parts("Hello there. How are", "sentence") == [
        ("Hello there.", True),
        (" How are", False),
    ]
    assert split_parts("It costs 3.5 euros", "sentence") == [("It costs 3.5 euros", False)]
    assert split_parts('He said "hi!" then', "sentence") == [
        ('He said "hi!"', True),
        (" then", False),
    ]
    assert split_parts("你好。我是千问", "sentence") == [("你好。", True), ("我是千问", False)]
    assert split_parts("नमस्ते। ठीक", "sentence") == [("नमस्ते।", True), (" ठीक", False)]
    assert split_parts("One, two; three", "clause") == [
        ("One,", True),
        (" two;", True),
        (" three", False),
    ]
    assert split_parts("One, two.", "none") == [("One, two.", False)]
    assert split_parts("", "sentence") == [] == split_parts("", "none")


def test_a_flood_of_short_sentences_queues_a_bounded_backlog():
    """Past max_pending, sentence ends are not cut: the text joins the last one waiting, whose
    length the utterance limit bounds (then POST's error for a long input)."""
    backlog: Backlog[Item] = Backlog(4, Limits(max_input_chars=100))
    with pytest.raises(RequestError) as e:
        for _ in range(1000):
            for part, ends in split_parts("Hi. ", "sentence"):
                backlog.add(part, ends, Item)
    assert e.value.param == "input" and "longer than 100" in e.value.message
    texts = [i for i in backlog.items if isinstance(i, Item)]
    assert backlog.waiting == len(texts) == 4 and sum(t.text.chars for t in texts) <= 4 * 100
    assert [t.text.ended for t in texts] == [True, True, True, False]
    assert backlog.pop() is texts[0] and backlog.waiting == 3
    whole = Item()
    whole.text.append("A whole commit.")
    backlog.push(whole)
    assert backlog.waiting == 4 and whole.text.ended
    with pytest.raises(RequestError) as e:  # a whole text past the bound: a 429
        backlog.push(whole)
    assert e.value.status == 429 and "ws_max_pending" in e.value.message


def test_a_message_holds_no_more_text_than_an_utterance():
    limits = Limits(max_input_chars=10)
    assert check_piece("short", "text", limits) == "short"
    with pytest.raises(RequestError) as e:
        check_piece("x" * 11, "text", limits)
    assert e.value.status == 400 and e.value.param == "input"  # POST's error, at once
    with pytest.raises(RequestError):
        check_piece(3, "text", limits)


def test_the_limits_are_read_from_the_server_config():
    config = ServerConfig(ws_idle_timeout_s=7.0, ws_max_pending=5, limits=Limits(max_input_chars=9))
    limits = SessionLimits.of(config)
    assert (limits.idle_s, limits.max_pending, limits.max_text_chars) == (7.0, 5, 9)
    assert set(LIMITS) == set(SessionLimits.__dataclass_fields__)


@pytest.mark.parametrize(
    "text", ["é" * 200, "a" * 122 + "€" * 3, "日本語のエラー" * 40, "x" * 300, "ok"]
)
def test_a_close_reason_is_at_most_123_bytes_of_whole_characters(text):
    reason = close_reason(text)
    assert len(reason) <= MAX_CLOSE_REASON_BYTES
    assert text.startswith(reason.decode("utf-8"))  # valid UTF-8, a prefix of the text
    assert len(text.encode()) <= MAX_CLOSE_REASON_BYTES or len(reason) > MAX_CLOSE_REASON_BYTES - 4


def test_the_docs_limits_table_names_each_core_field_and_its_config_field():
    """docs/engine-api.md's socket limits table: every SessionLimits field, each with the
    ServerConfig field it is read from, and nothing else in that column."""
    doc = (Path(__file__).parents[3] / "docs" / "engine-api.md").read_text()
    section = doc.split("### Limits of the socket", 1)[1].split("\n### ", 1)[0]
    named = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 4 and (m := re.fullmatch(r"`(\w+)` \(`([\w.]+)`.*\)", cells[1])):
            named[m.group(1)] = m.group(2)
    named.update(dict.fromkeys(re.findall(r"`(send_buffer_bytes|send_timeout_s)`", section)))
    assert set(named) == set(LIMITS), set(named) ^ set(LIMITS)
    for field, config in named.items():
        assert config is None or LIMITS[field] == config, (field, config)


def test_serve_flags_reach_the_cores_flow_control_and_backlog_limits():
    from qwen3_tts_engine.cli import build_parser, engine_config
    from qwen3_tts_engine.serving.session_limits import SessionLimits

    serve = ["serve", "--model", "/nonexistent/checkpoint"]  # nothing is loaded here
    default = engine_config(build_parser().parse_args(serve)).server
    custom = engine_config(build_parser().parse_args(
        [*serve, "--ws-ahead", "1.5", "--ws-max-pending", "7"])).server  # fmt: skip
    assert (default.ws_ahead_s, default.ws_max_pending) == (3.0, 64)
    limits = SessionLimits.of(custom)
    assert (limits.ahead_s, limits.max_pending) == (1.5, 7)
