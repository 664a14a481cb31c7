#!/usr/bin/env bash
# The agent's bundled standby clips (agent/voice_agent/assets/standby/): what it says while no TTS
# engine can speak and none ever has in this process (voice_agent/standby.py). espeak-ng speech,
# 8 kHz 16-bit mono (phone quality keeps the pair under 100 KB). Rerun after changing a phrase.
set -euo pipefail
cd "$(dirname "$0")/.."
out=agent/voice_agent/assets/standby
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say() {  # name text
  espeak-ng -v en-us -s 165 -w "$tmp/$1.wav" "$2"
  sox "$tmp/$1.wav" -r 8000 -c 1 -b 16 "$out/$1.wav"
}
# the phrases of voice_agent.standby (HOLD_PHRASE, APOLOGY_PHRASE)
say hold "One moment, please."
say apology "Sorry, I can't answer right now. Please try again in a moment."
ls -l "$out"
