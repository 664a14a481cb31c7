# Sourced by the set-up scripts: apt_install PKG... installs Debian packages as root, or exits
# with the command a user should run. The caller's log() prints the messages.
apt_install() {
  [ $# -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian packages: $*"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    log "ERROR: missing Debian packages: $* (run as root, or: sudo apt-get install $*)"
    exit 1
  fi
}
