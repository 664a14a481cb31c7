#!/usr/bin/env bash
# The README's test command: set up everything, check the dependency tree, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# CI (CI set and not 0/false) must run every test: a missing tool is a failure there, while a
# local run skips the tests that need it (each skip prints its reason in the summary).
in_ci() { case "${CI:-}" in ""|0|false|False|FALSE) return 1;; *) return 0;; esac; }
# The tools some tests need, installed at once (they are independent; only the browser's may
# use apt, after bootstrap's): livekit-server and promtool built with Go (kept per version in the
# user's cache, scripts/tool_cache.sh), Debian's chromium and the browser test's npm packages.
# Each one that fails fails the run under CI; elsewhere the tests that need it are skipped.
declare -A installing=(
  ["livekit-server"]=scripts/install_livekit_server.sh
  ["the browser test's tools"]=scripts/install_browser.sh
  ["promtool"]=scripts/install_promtool.sh
)
declare -A installer_pid=()
missing_tools=()
for what in "${!installing[@]}"; do bash "${installing[$what]}" & installer_pid[$what]=$!; done
for what in "${!installer_pid[@]}"; do  # every installer has ended before this goes on
  wait "${installer_pid[$what]}" || missing_tools+=("$what")
done
for what in "${missing_tools[@]}"; do
  if in_ci; then echo "ERROR: CI is set and $what could not be installed (see above)" >&2; exit 1; fi
  echo "WARNING: $what missing: the tests that need it will be skipped" >&2
done
export LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE=0 HF_HUB_OFFLINE=1
# One BLAS/OpenMP thread per process: the suite's parallelism is its pytest workers and the
# servers they start, and more threads per process only contend for the same cores (OpenBLAS's
# idle threads spin): the suite used 7 % less CPU (1168 -> 1092 CPU-s, docs/benchmarks.md).
# tests/engine/worker/test_blas_threads.py sets its own counts.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# No torch in the environment; the check fails loudly if the package listing itself fails.
if .venv/bin/python -m pip --version >/dev/null 2>&1; then lister=(.venv/bin/python -m pip list); else lister=(.cache/uv/bin/uv pip list --python .venv/bin/python); fi
if ! packages=$("${lister[@]}" 2>&1) || ! grep -qiE '^livekit-agents[[:space:]]' <<<"$packages"; then
  echo "ERROR: could not list the environment's packages (${lister[*]}):" >&2
  echo "$packages" | tail -5 >&2
  exit 1
fi
if grep -iE '^(torch|torchaudio|torchvision|silero-vad)[[:space:]]' <<<"$packages"; then
  echo "ERROR: torch (or silero-vad, which pulls it in) is in the environment; it must not be." >&2
  exit 1
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .  # one style (ruff format; a statement may opt out with "# fmt: skip")
# Import contracts (pyproject.toml [tool.importlinter]): the engine never imports LiveKit, its
# layers point one way, the agent uses its public API only.
.venv/bin/lint-imports
# Three pytest workers (pytest-xdist), one test file at a time each, on CI's 2 cores: two leave
# the CPU ~13 % idle (tests wait on servers and sockets) and ran 537-723 s in all on one commit;
# three are 60-190 s faster (docs/benchmarks.md). PYTEST_WORKERS=2 runs two, 0 one process.
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
