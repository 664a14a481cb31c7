#!/usr/bin/env bash
# The README's test command: set up everything, check the dependency tree, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The LiveKit call test needs a livekit-server binary (built with Go); without one it is skipped.
bash scripts/install_livekit_server.sh || echo "WARNING: no livekit-server; the LiveKit call test will be skipped" >&2
# The browser-client test needs Debian's chromium and the npm packages (livekit-client, playwright-core).
bash scripts/install_browser.sh || echo "WARNING: browser test dependencies missing; the browser test will be skipped (with CI set: fail)" >&2
source .venv/openblas.env
export LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE=0 HF_HUB_OFFLINE=1

if .venv/bin/python -m pip --version >/dev/null 2>&1; then lister=(.venv/bin/python -m pip list); else lister=(.cache/uv/bin/uv pip list --python .venv/bin/python); fi
if "${lister[@]}" 2>/dev/null | grep -iE '^(torch|torchaudio|torchvision|silero-vad)[[:space:]]'; then
  echo "ERROR: torch (or silero-vad, which pulls it in) is in the environment; it must not be." >&2
  exit 1
fi

.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
