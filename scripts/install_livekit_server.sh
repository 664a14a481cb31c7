#!/usr/bin/env bash
# Installs the pinned LiveKit server (a Go program: on none of PyPI, npm or Debian) into
# .cache/bin/livekit-server, built from source with the Go toolchain through the Go module proxy.
# Cached: does nothing when that binary already reports the pinned version.
# v1.13.x does not build this way: its go.mod replaces pion with livekit forks the proxy refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.9.12
BIN_DIR="$PWD/.cache/bin"
BIN="$BIN_DIR/livekit-server"

source scripts/tool_cache.sh
if [[ -x "$BIN" ]] && "$BIN" --version 2>/dev/null | grep -q "version $VERSION\$"; then
  echo "livekit-server $VERSION already installed: $BIN"
  exit 0
fi
if tool_cache_get livekit-server "$VERSION" "$BIN" && "$BIN" --version 2>/dev/null | grep -q "version $VERSION\$"; then
  echo "livekit-server $VERSION copied from $TOOL_CACHE: $BIN"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "ERROR: 'go' is not installed; it is needed to build livekit-server $VERSION" >&2
  echo "       (install Go >= 1.24 from https://go.dev/dl/, or set LIVEKIT_SERVER_BIN to a prebuilt binary," >&2
  echo "       or LIVEKIT_URL to a running server; the LiveKit call test is skipped otherwise)" >&2
  exit 1
fi

mkdir -p "$BIN_DIR"
echo "building livekit-server $VERSION with $(go version) (a few minutes on 2 cores)..."
if ! GOBIN="$BIN_DIR" go install "github.com/livekit/livekit-server/cmd/server@v$VERSION"; then
  echo "ERROR: building livekit-server $VERSION failed (see the go output above)" >&2
  exit 1
fi
mv -f "$BIN_DIR/server" "$BIN"
if ! "$BIN" --version 2>/dev/null | grep -q "version $VERSION\$"; then
  echo "ERROR: $BIN does not report version $VERSION: $("$BIN" --version 2>&1 || true)" >&2
  exit 1
fi
tool_cache_put livekit-server "$VERSION" "$BIN"
echo "installed $("$BIN" --version) at $BIN"
