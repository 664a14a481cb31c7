#!/usr/bin/env bash
# One-time (and idempotent) set-up: system packages (Debian's apt, or Homebrew on a Mac), uv, and
# the project's virtual environment. Re-running it on a machine that is already set up takes about
# a second. BOOTSTRAP_DRY_RUN=1 prints what it would install, run and write, and changes nothing;
# BOOTSTRAP_UNAME / BOOTSTRAP_ARCH stand in for `uname -s` / `uname -m` (tests/infra/test_mac_path.py
# runs the Mac branch on Linux that way, with stand-in brew and python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2: `ip netns` for the link bench's delay line (voice_agent/lab/delay_line.py)
DEBIAN_PACKAGES=(espeak-ng sox libportaudio2 libopenblas0-pthread python3-venv haproxy iproute2)
# On a Mac, Homebrew's espeak-ng and sox give the tests the speech they get on Linux; without
# them the demo speaks with macOS's own `say`. sounddevice's macOS wheel bundles PortAudio, PyAV's
# bundles FFmpeg: nothing else is needed from Homebrew.
BREW_PACKAGES=(espeak-ng sox)
BREW_PYTHON=python@3.12  # only when no Python >= 3.11 for arm64 is found
HOMEBREW_INSTALL='/bin/bash -c "$(curl -fsSL https://raw.githubusercontent.com/Homebrew/install/HEAD/install.sh)"'
UV_VERSION="0.13.9"
TOOLS=.cache/uv
UNAME="${BOOTSTRAP_UNAME:-$(uname -s)}"
ARCH="${BOOTSTRAP_ARCH:-$(uname -m)}"
DRY_RUN="${BOOTSTRAP_DRY_RUN:-0}"

log() { printf '[bootstrap] %s\n' "$*" >&2; }
dry_run() { [ "$DRY_RUN" != 0 ]; }
run() { if dry_run; then log "would run: $*"; else "$@"; fi; }

# python_ok EXE: Python >= 3.11; on a Mac also an arm64 build (mlx has no x86_64 macOS wheel).
python_ok() {
  local info
  info=$("$1" -c 'import platform, sys; print(sys.version_info >= (3, 11), platform.machine())' \
    2>/dev/null) || return 1
  case "$UNAME:$info" in
    Darwin:"True arm64") return 0 ;;
    Darwin:*) return 1 ;;
    *:"True "*) return 0 ;;
  esac
  return 1
}

# find_python: the first acceptable Python on a Mac: $PYTHON, python3, python3.13 ... python3.11.
find_python() {
  local c
  for c in ${PYTHON:+"$PYTHON"} python3 python3.13 python3.12 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && python_ok "$c"; then command -v "$c"; return 0; fi
  done
  return 1
}

macos_packages() {
  if [ "$ARCH" != arm64 ]; then
    log "ERROR: MLX needs Apple Silicon (arm64); this shell reports $ARCH: an Intel Mac, or a" \
      "terminal running under Rosetta (open a native one: \`arch -arm64 bash scripts/bootstrap.sh\`)"
    exit 1
  fi
  # a word list, not an array: macOS's /bin/bash is 3.2, where an empty array trips `set -u`
  local brew tool missing=""
  brew=$(command -v brew || true)
  # a fresh Homebrew is not on PATH until its `shellenv` line is in the shell's profile
  if [ -z "$brew" ] && [ -x /opt/homebrew/bin/brew ]; then brew=/opt/homebrew/bin/brew; fi
  if [ -n "$brew" ]; then PATH="$(dirname "$brew"):$PATH"; fi
  for tool in "${BREW_PACKAGES[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
  done
  PYTHON=$(find_python) || { PYTHON=""; missing="$missing $BREW_PYTHON"; }
  missing="${missing# }"
  if [ -z "$missing" ]; then
    return 0
  fi
  if [ -n "$brew" ]; then
    log "installing with Homebrew: $missing"
    # shellcheck disable=SC2086  # one word per package
    run "$brew" install $missing
    if [ -z "$PYTHON" ]; then
      if dry_run; then PYTHON="python${BREW_PYTHON#python@}"; return 0; fi
      PYTHON=$(find_python) || {
        log "ERROR: Homebrew installed $BREW_PYTHON but no python3.12 is on PATH: run" \
          "\`eval \"\$($brew shellenv)\"\`, then this script again"
        exit 1
      }
    fi
  elif [ -z "$PYTHON" ]; then
    log "ERROR: Python >= 3.11 for arm64 is needed and Homebrew is not installed. Install Homebrew"
    log "with this one command, then run this script again (it installs the rest):"
    log "  $HOMEBREW_INSTALL"
    log "(or install Python 3.12 from https://www.python.org/downloads/macos/ and set PYTHON to it)"
    exit 1
  else
    log "WARNING: $missing not installed and no Homebrew: the demo speaks its question with"
    log "macOS's say; the tests that need espeak-ng are skipped. To install them: install Homebrew"
    log "($HOMEBREW_INSTALL), then: brew install $missing"
  fi
}

debian_packages() {
  local p missing=()
  if command -v dpkg-query >/dev/null; then
    for p in "${DEBIAN_PACKAGES[@]}"; do
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
  fi
  if dry_run; then
    [ ${#missing[@]} -eq 0 ] || log "would install Debian packages: ${missing[*]}"
  else
    source scripts/apt_install.sh
    apt_install "${missing[@]}"
  fi
  PYTHON="${PYTHON:-python3}"
  python_ok "$PYTHON" || {
    log "ERROR: Python >= 3.11 is required ($PYTHON is $("$PYTHON" --version 2>&1))"; exit 1; }
}

if [ "$UNAME" = Darwin ]; then macos_packages; else debian_packages; fi

if [ ! -x "$TOOLS/bin/uv" ] || [ "$("$TOOLS/bin/uv" --version | awk '{print $2}')" != "$UV_VERSION" ]; then
  log "installing uv $UV_VERSION into $TOOLS"
  run "$PYTHON" -m venv "$TOOLS"
  run "$TOOLS/bin/pip" install -q "uv==$UV_VERSION"
fi

# uv sync --frozen installs exactly uv.lock; it is a no-op when .venv already matches.
# --compile-bytecode: uv does not write .pyc files by default, and where PYTHONDONTWRITEBYTECODE
# is set (CI images, containers) Python never caches them either, so every process would
# compile transformers, livekit-agents and the rest from source: importing an engine worker took
# 4.4 s of CPU instead of 1.6 s, an agent process 4.6 s instead of 1.8 s.
run "$TOOLS/bin/uv" sync --frozen --quiet --compile-bytecode --python "$PYTHON"
# The workspace's own packages (editable installs) too; up-to-date files are skipped.
run .venv/bin/python -m compileall -q -j 0 agent engine plugins >/dev/null

# No environment file to source: every `qwen3-tts` command and engine worker that runs mlx on
# Linux loads Debian's OpenBLAS itself (engine/qwen3_tts_engine/fast_blas.py; mlx-cpu links the
# reference BLAS, ~6x slower first audio). A Mac runs mlx on Metal. An .venv/openblas.env left by
# an older checkout is removed, so nothing keeps sourcing it.
if dry_run; then
  [ ! -e .venv/openblas.env ] || log "would remove .venv/openblas.env (no longer used)"
else
  rm -f .venv/openblas.env
fi
