"""The engine is its own package: its handler workers load no LiveKit, the LiveKit plugin needs
no mlx, and the engine image installs from the engine package alone (the import contracts:
tests/infra/test_import_contracts.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from livekit.agents.tokenize import basic

from qwen3_tts_engine.dispatch.handler import Handler
from qwen3_tts_engine.sentences import split_input

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
UV = REPO / ".cache/uv/bin/uv"


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def test_a_handler_worker_loads_no_livekit(tiny_checkpoint):
    handler = Handler(str(tiny_checkpoint("custom_voice", eos="text")), None, warmup=True)
    await handler.start()  # loaded and warmed up: a synthesis (sentence splitting included) ran
    try:
        maps = await asyncio.to_thread(_maps, handler.pid)
    finally:
        await handler.stop()
    assert "libmlx" in maps or "/mlx/" in maps  # the check reads the right process
    assert "livekit" not in maps, [line for line in maps.splitlines() if "livekit" in line][:5]
    # mlx-audio imports scipy.signal on the way (about half of a worker's start here): deferred
    # until used, and Qwen3-TTS never uses it (worker/deferred.py DEFERRED_IMPORTS)
    assert "scipy/signal" not in maps, [
        line for line in maps.splitlines() if "scipy/signal" in line
    ][:5]


def test_a_deferred_import_loads_when_used():
    """Importing the worker package defers scipy.signal (before mlx-audio can import it); the
    deferred module loads at its first use."""
    code = ("import sys; print('scipy.signal' in sys.modules); import qwen3_tts_engine.worker; "
            "import mlx_audio.tts.models.qwen3_tts; from scipy import signal; "
            "print(type(sys.modules['scipy.signal']).__name__); "
            "print(signal.resample_poly([1.0, 1.0, 1.0, 1.0], 2, 1).shape); "
            "print(type(sys.modules['scipy.signal']).__name__); "
            "from qwen3_tts_engine.worker.deferred import defer_unused_imports; "
            "print(defer_unused_imports())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:5] == ["False", "_LazyModule", "(8,)", "module", "[]"]


def test_the_worker_module_imports_no_livekit():
    code = ("import sys; import qwen3_tts_engine.worker.main, qwen3_tts_engine.worker.loading, "
            "qwen3_tts_engine.worker.synthesis; "
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('livekit')}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_plugin_declares_and_locks_no_mlx():
    project = tomllib.loads((REPO / "plugins/livekit-plugins-qwen3-tts/pyproject.toml").read_text())
    declared = project["project"]["dependencies"] + [
        d for extra in project["project"].get("optional-dependencies", {}).values() for d in extra
    ]
    assert not [d for d in declared if d.lower().startswith(("mlx", "qwen3-tts-engine"))], declared
    # ... nor does anything it depends on, by the lock
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    packages = {p["name"]: p for p in lock["package"]}
    seen, todo = set(), ["livekit-plugins-qwen3-tts"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [d["name"] for d in packages[name].get("dependencies", [])]
    assert not {n for n in seen if n.startswith("mlx") or n == "qwen3-tts-engine"}, seen


def test_the_plugin_works_with_mlx_unimportable():
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("mlx", "mlx_audio", "mlx_lm", "qwen3_tts_engine"):
                    raise ImportError(f"{name} is blocked for this test")
        sys.meta_path.insert(0, Block())
        from livekit.plugins import qwen3_tts
        tts = qwen3_tts.TTS(base_url="http://127.0.0.1:9", voice="ryan")
        assert tts.sample_rate == 24000
        assert not [m for m in sys.modules if m.split(".")[0] in ("mlx", "qwen3_tts_engine")]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _engine_stage_files() -> list[str]:
    """What the Dockerfile's base and tts-engine stages copy from the repository."""
    stage, out = None, []
    for line in (REPO / "infra/docker/agent.Dockerfile").read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            stage = rest.split()[-1]
        elif word == "COPY" and stage in ("base", "tts-engine"):
            out += rest.split()[:-1]
    return out


@pytest.mark.skipif(not UV.is_file(), reason="uv is installed by scripts/bootstrap.sh")
def test_the_engine_image_installs_the_engine_package_alone(tmp_path):
    for src in _engine_stage_files():
        target = tmp_path / src
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, target, ignore=shutil.ignore_patterns("__pycache__"),
                            dirs_exist_ok=True)  # fmt: skip
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / src, target)
    assert not (tmp_path / "agent/voice_agent").exists()  # manifests only for other members
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / ".venv")}
    out = subprocess.run([str(UV), "sync", "--frozen", "--no-dev", "--package", "qwen3-tts-engine",
                          "--dry-run", "--offline"], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    plan = [line.split()[1].split("==")[0] for line in (out.stdout + out.stderr).splitlines()
            if line.startswith(" + ")]  # fmt: skip
    assert "qwen3-tts-engine" in plan and "mlx-audio" in plan
    assert not [p for p in plan if p.startswith(("livekit", "grpcio", "openai"))], plan
    # tracing: the API, SDK and the OTLP/HTTP exporter only
    assert {
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
    } <= set(plan)
    assert "matplotlib" not in plan  # the [quant] extra's
    print(f"engine image: {len(plan)} packages")


TEXTS = [
    "Hello there. How are you today? I am fine!",
    "Dr. Smith lives at 221 B. Baker St. in London. He is 3.5 m tall.",
    "Visit example.com for more... Or call us at 555.1234. Thanks!",
    "The U.S.A. is large. However it is not the largest country.",
    "Short. Tiny. Ends here. And this one is long enough to stand alone.",
    "Mr. and Mrs. Jones arrived at 10 p.m. They were late.",
    "你好。今天天气很好！你呢？",
    "One line\nand another line. Then a third sentence follows here.",
    "No punctuation at all in this one",
]


@pytest.mark.parametrize("text", TEXTS)
def test_sentences_split_as_livekit_splits_them(text):
    theirs = [s.strip() for s in basic.SentenceTokenizer(min_sentence_len=20).tokenize(text)]
    assert split_input(text) == ([s for s in theirs if s] or [text.strip()])
