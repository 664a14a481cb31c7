#!/usr/bin/env bash
# One-time (and idempotent) set-up: Debian packages, uv, and the project's virtual environment.
# Re-running it on a machine that is already set up takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(espeak-ng sox libportaudio2 libopenblas0-pthread python3-venv)
UV_VERSION="0.13.9"
TOOLS=.cache/uv

log() { printf '[bootstrap] %s\n' "$*" >&2; }

missing=()
if command -v dpkg-query >/dev/null; then
  for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
fi
source scripts/apt_install.sh
apt_install "${missing[@]}"

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null || {
  log "ERROR: Python >= 3.11 is required ($PYTHON is $("$PYTHON" --version 2>&1))"; exit 1; }

if [ ! -x "$TOOLS/bin/uv" ] || [ "$("$TOOLS/bin/uv" --version | awk '{print $2}')" != "$UV_VERSION" ]; then
  log "installing uv $UV_VERSION into $TOOLS"
  "$PYTHON" -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q "uv==$UV_VERSION"
fi

# uv sync --frozen installs exactly uv.lock; it is a no-op when .venv already matches.
"$TOOLS/bin/uv" sync --frozen --quiet --python "$PYTHON"

# mlx-cpu links the reference BLAS; Debian's OpenBLAS is ~10x faster for fp32 GEMM (docs/mlx-on-linux.md).
OPENBLAS=$(ls /usr/lib/*/libopenblas.so.0 /usr/lib/*/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1 || true)
printf 'export LD_PRELOAD=%s\n' "$OPENBLAS" > .venv/openblas.env
