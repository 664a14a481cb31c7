"""Under CI every skip is a failure (tests/conftest.py): a test that skips for a missing tool, a
permission or a model file cannot let CI pass by running less. Checked on a real pytest run of a
test that skips, with CI set and unset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_skipping.py").write_text(
        "import pytest\n\n"
        "def test_needs_a_tool():\n    pytest.skip('no frobnicator on PATH')\n\n"
        "@pytest.mark.skipif(True, reason='reads /proc/PID/maps')\n"
        "def test_for_another_platform():\n    pass\n"
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                           "-p", "no:xdist", f"--rootdir={tmp_path}", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip


def test_a_skip_fails_under_ci_with_its_reason(tmp_path):
    out = _run(tmp_path, "true")
    assert out.returncode == 1, out.stdout[-2000:]
    assert "FAILED" in out.stdout and "no frobnicator on PATH" in out.stdout
    assert "1 failed, 1 skipped" in out.stdout  # another platform's test stays a skip


def test_a_skip_is_a_skip_elsewhere(tmp_path):
    for ci in (None, "0", "false"):
        out = _run(tmp_path, ci)
        assert out.returncode == 0, out.stdout[-2000:]
        assert "2 skipped" in out.stdout and "no frobnicator on PATH" in out.stdout
