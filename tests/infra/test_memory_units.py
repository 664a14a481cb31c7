"""Sizes the pages state are the code's, in the unit they name (MiB is 2^20 bytes, MB 10^6), and
the agent worker's manifest names the engine's memory limit as tts-engine.yaml sets it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from qwen3_tts_engine.serving.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"MiB": 2**20, "MB": 10**6}


def _row(page: str, name: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return next(line for line in text.splitlines() if line.startswith("|") and f"`{name}`" in line)


def _size(cell: str) -> int:
    number, unit = re.search(r"(\d+) (MiB|MB)\b", cell).groups()
    return int(number) * UNITS[unit]


def test_the_socket_limits_table_states_the_configs_sizes():
    config = ServerConfig()
    assert _size(_row("engine-api.md", "max_body_bytes")) == config.max_body_bytes
    assert (
        _size(_row("engine-api.md", "ServerConfig.ws_send_buffer_bytes"))
        == config.ws_send_buffer_bytes
    )


def test_the_agent_workers_manifest_names_the_engines_limit():
    engine = next(d for d in yaml.safe_load_all((ROOT / "infra/k8s/tts-engine.yaml").read_text())
                  if d and d.get("kind") == "Deployment")  # fmt: skip
    limit = engine["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    agent = (ROOT / "infra/k8s/agent-worker.yaml").read_text()
    named = re.findall(r"the engine's (\d+Mi)", agent)
    assert named == [limit], (named, limit)
