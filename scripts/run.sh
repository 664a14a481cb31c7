#!/usr/bin/env bash
# The README's run command: set up everything, then run the main job (the voice-agent demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export LIVEKIT_AGENTS_PRELOAD_LOCAL_INFERENCE=0
exec .venv/bin/voice-agent demo "$@"
