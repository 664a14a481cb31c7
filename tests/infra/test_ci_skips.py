"""Under CI every skip is a failure (tests/conftest.py): a test that skips for a missing tool, a
permission or a model file cannot let CI pass by running less. Checked on a real pytest run of a
test that skips, with CI set and unset."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


_SKIPPING = (
    "import pytest\n\n"
    "def test_needs_a_tool():\n    pytest.skip('no frobnicator on PATH')\n\n"
    "@pytest.mark.skipif(True, reason='reads /proc/PID/maps')\n"
    "def test_for_another_platform():\n    pass\n"
)  # fmt: skip


def _run(
    tmp_path: Path, ci: str | None, tests: str = _SKIPPING, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_skipping.py").write_text(tests)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                           "-p", "no:xdist", f"--rootdir={tmp_path}", *args, str(tmp_path)],
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


# A skip at import is a collection report, not a test's: the rule covers it too.
_SKIPPING_AT_IMPORT = "import pytest\n\nfrob = pytest.importorskip('no_such_frobnicator')\n\ndef test_a():\n    pass\n"


def test_a_module_level_skip_fails_under_ci(tmp_path):
    out = _run(tmp_path, "true", _SKIPPING_AT_IMPORT)
    assert out.returncode != 0, out.stdout[-2000:]
    assert (
        "skipped at collection, and CI is set" in out.stdout and "no_such_frobnicator" in out.stdout
    )
    out = _run(
        tmp_path, "true", "import pytest\npytest.skip('no frobnicator', allow_module_level=True)\n"
    )
    assert out.returncode != 0 and "skipped at collection" in out.stdout, out.stdout[-2000:]
    out = _run(tmp_path, None, _SKIPPING_AT_IMPORT)
    assert out.returncode in (0, 5) and "1 skipped" in out.stdout, out.stdout[
        -2000:
    ]  # 5: no test ran


def test_a_shallow_clone_fails_test_docs_under_ci(tmp_path):
    """test_docs looks the benchmarks page's commits up in git's history: a clone without it
    (shallow) cannot, and CI must not pass by checking less."""
    clone = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    for path in ("tests/conftest.py", "tests/infra/test_docs.py"):  # as they are in this tree
        shutil.copy(REPO / path, clone / path)
    env = {
        **{k: v for k, v in os.environ.items() if k != "CI"},
        "CI": "true",
        "PYTHONPATH": str(clone),
    }
    test = "tests/infra/test_docs.py::test_the_stamped_commits_exist"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "no:xdist", test],
                         capture_output=True, text=True, env=env, cwd=clone, timeout=300)  # fmt: skip
    assert out.returncode == 1 and "no full git history" in out.stdout, out.stdout[-2000:]
