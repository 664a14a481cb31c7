#!/usr/bin/env bash
# Installs what the browser-client test needs, from registries only (no browser download):
#   - Debian's `chromium` (apt-get, as root; skipped when /usr/bin/chromium exists),
#   - Node.js + npm from Debian when `npm` is missing,
#   - `npm ci` of agent/voice_agent/web (livekit-client, whose UMD build `voice-agent web` serves)
#     and of tests/support/browser (playwright-core, which drives the system Chromium).
# Idempotent: a set-up machine takes well under a second (npm ci runs only when a lock file is
# newer than its node_modules). Exits non-zero with the reason when something cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[install_browser] %s\n' "$*" >&2; }
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm_config_audit=false npm_config_fund=false \
  npm_config_update_notifier=false

missing=()
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || missing+=(chromium)
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
source scripts/apt_install.sh
apt_install "${missing[@]}"

# npm ci for each package folder whose node_modules is missing or older than its lock file.
for dir in agent/voice_agent/web tests/support/browser; do
  stamp="$dir/node_modules/.package-lock.json"  # npm writes it on every install
  if [ -f "$stamp" ] && [ ! "$dir/package-lock.json" -nt "$stamp" ]; then
    continue
  fi
  log "npm ci in $dir"
  if ! npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error >/dev/null; then
    log "ERROR: npm ci failed in $dir (is the npm registry reachable?)"
    exit 1
  fi
done

test -f agent/voice_agent/web/node_modules/livekit-client/dist/livekit-client.umd.js || {
  log "ERROR: livekit-client's UMD build is missing after npm ci"; exit 1; }
echo "browser test dependencies ready: $(command -v chromium || echo /usr/bin/chromium)" \
  "($(chromium --version 2>/dev/null || echo 'version unknown')), livekit-client, playwright-core"
