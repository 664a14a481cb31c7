#!/usr/bin/env bash
# Installs Prometheus's promtool (it checks the scrape config and the dashboard's queries in
# tests/infra/test_observability_infra.py) into .cache/bin/promtool, built with the Go toolchain
# through the Go module proxy. Debian's `prometheus` package ships a promtool built without
# Kubernetes service discovery, which rejects the Kubernetes scrape job. Cached: does nothing
# when that binary already reports the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.316.0  # Go module version of Prometheus 3.x's github.com/prometheus/prometheus
BIN_DIR="$PWD/.cache/bin"
BIN="$BIN_DIR/promtool"

source scripts/tool_cache.sh
if [[ -x "$BIN" ]] && [[ -f "$BIN.version" ]] && [[ "$(cat "$BIN.version")" == "$VERSION" ]]; then
  echo "promtool $VERSION already installed: $BIN"
  exit 0
fi
if tool_cache_get promtool "$VERSION" "$BIN" && "$BIN" --version >/dev/null 2>&1; then
  echo "$VERSION" > "$BIN.version"
  echo "promtool $VERSION copied from $TOOL_CACHE: $BIN"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "ERROR: 'go' is not installed; it is needed to build promtool $VERSION" >&2
  exit 1
fi
mkdir -p "$BIN_DIR"
echo "building promtool $VERSION with $(go version) (a few minutes on 2 cores)..."
if ! GOBIN="$BIN_DIR" GOFLAGS=-mod=mod go install "github.com/prometheus/prometheus/cmd/promtool@v$VERSION"; then
  echo "ERROR: building promtool $VERSION failed (see the go output above)" >&2
  exit 1
fi
"$BIN" --version >/dev/null
echo "$VERSION" > "$BIN.version"
tool_cache_put promtool "$VERSION" "$BIN"
echo "installed promtool $VERSION at $BIN"
