"""The import contracts (pyproject.toml [tool.importlinter]) hold, each one catches a deliberate
violation, and no two modules import each other, counting imports inside functions.

import-linter counts function-local imports too; the cycle check here does so explicitly, so
that no circle is hidden by an import moved into a function.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
    "contracts"
]
PACKAGES = {  # import name -> source folder
    "qwen3_tts_engine": REPO / "engine/qwen3_tts_engine",
    "voice_agent": REPO / "agent/voice_agent",
    "livekit.plugins.qwen3_tts": REPO
    / "plugins/livekit-plugins-qwen3-tts/livekit/plugins/qwen3_tts",
    "livekit.plugins.faster_whisper": REPO
    / "plugins/livekit-plugins-faster-whisper/livekit/plugins/faster_whisper",
}

# One deliberate violation per contract: (file in a copy of the packages, line appended, what
# lint-imports must then name).
VIOLATIONS = {
    "engine-no-livekit": (
        "qwen3_tts_engine/worker/main.py",
        "import livekit.agents",
        "qwen3_tts_engine.worker.main -> livekit",
    ),
    "engine-process-boundary": (
        "qwen3_tts_engine/dispatch/handler.py",
        "def _x():\n    import mlx.core  # noqa",
        "qwen3_tts_engine.dispatch.handler -> mlx",
    ),
    "engine-layers": (
        "qwen3_tts_engine/models/variants.py",
        "from qwen3_tts_engine.serving.app import EngineServer",
        "qwen3_tts_engine.models.variants -> qwen3_tts_engine.serving.app",
    ),
    "serving-layers": (
        "qwen3_tts_engine/serving/speech_stream.py",
        "from qwen3_tts_engine.serving.speech import SpeechRoutes",
        "qwen3_tts_engine.serving.speech_stream -> qwen3_tts_engine.serving.speech",
    ),
    "agent-engine-api": (
        "voice_agent/services/engine.py",
        "from qwen3_tts_engine.worker import scheduler",
        "voice_agent.services.engine -> qwen3_tts_engine.worker",
    ),
    "agent-layers": (
        "voice_agent/pipeline.py",
        "from voice_agent import worker",
        "voice_agent.pipeline -> voice_agent.worker",
    ),
    "agent-product-path": (
        "voice_agent/worker.py",
        "from voice_agent.harness import demo",
        "voice_agent.worker -> voice_agent.harness",
    ),
    "agent-engine-users": (
        "voice_agent/pipeline.py",
        "import qwen3_tts_engine.protocol",
        "voice_agent.pipeline -> qwen3_tts_engine",
    ),
    "agent-plugin-api": (
        "voice_agent/fleet_load.py",
        "from livekit.plugins.qwen3_tts.endpoints import EndpointPool",
        "voice_agent.fleet_load -> livekit.plugins.qwen3_tts.endpoints",
    ),
}


def _lint_imports(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


def test_the_import_contracts_hold():
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"{len(CONTRACTS)} kept, 0 broken" in out.stdout


def test_every_contract_has_a_violation_here():
    assert {c["id"] for c in CONTRACTS} == set(VIOLATIONS)


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> str:
    """lint-imports' report on a copy of the engine and the agent with every violation above."""
    root = tmp_path_factory.mktemp("contracts")
    for name in ("qwen3_tts_engine", "voice_agent"):
        shutil.copytree(
            PACKAGES[name],
            root / name,
            ignore=shutil.ignore_patterns("__pycache__", "node_modules"),
        )
    for rel, line, _ in VIOLATIONS.values():
        with (root / rel).open("a") as f:
            f.write(f"\n{line}  # noqa\n")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copies shadow the installed packages
    out = _lint_imports(root, env)
    assert out.returncode != 0
    return out.stdout


@pytest.mark.parametrize("contract", [c["id"] for c in CONTRACTS])
def test_each_contract_catches_its_violation(broken, contract):
    name = next(c["name"] for c in CONTRACTS if c["id"] == contract)
    # lint-imports wraps long names: compare without line breaks
    flat = " ".join(broken.split())
    assert f"{' '.join(name.split())} BROKEN" in flat, broken[-4000:]
    assert VIOLATIONS[contract][2] in flat


# -- import cycles, function-local imports included ----------------------------------------------


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (TYPE_CHECKING blocks aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def target(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(t for a in child.names if (t := target(a.name)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - child.level + 1] + ([base] if base else [])
                    )
                for a in child.names:
                    if t := target(f"{base}.{a.name}") or target(base):
                        found.add(t)
            visit(child)

    visit(ast.parse(path.read_text()))
    # a package's own __init__ runs before any of its modules: not an edge of the graph
    return {t for t in found if t != name and not name.startswith(t + ".")}


def test_no_import_cycle_counting_function_local_imports():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            strongconnect(v)
    assert len(modules) > 100 and sum(map(len, graph.values())) > 200  # the graph was read
    assert not cycles, cycles
