# Sourced by the installers of Go-built tools: a built binary is kept per version in the user's
# cache (like uv's and Go's own caches), so a fresh clone copies it instead of linking it again
# (8-14 s each on 2 cores). QWEN3_VOICE_TOOL_CACHE moves it; `none` turns it off.
TOOL_CACHE="${QWEN3_VOICE_TOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen3-voice-agent/bin}"

# tool_cache_get NAME VERSION DEST: copy a cached build to DEST; fails when there is none
tool_cache_get() {
  [ "$TOOL_CACHE" != none ] && [ -x "$TOOL_CACHE/$1-$2" ] || return 1
  mkdir -p "$(dirname "$3")" && cp -f "$TOOL_CACHE/$1-$2" "$3.tmp" && mv -f "$3.tmp" "$3"
}

# tool_cache_put NAME VERSION SRC: keep a build (best effort: a read-only cache is no error)
tool_cache_put() {
  [ "$TOOL_CACHE" != none ] || return 0
  { mkdir -p "$TOOL_CACHE" && cp -f "$3" "$TOOL_CACHE/$1-$2.tmp.$$" \
      && mv -f "$TOOL_CACHE/$1-$2.tmp.$$" "$TOOL_CACHE/$1-$2"; } 2>/dev/null || true
}
