#!/usr/bin/env bash
# Installs the Debian packages the tests use: chromium (browser tests) and redis-server
# (fleet tests). Idempotent: does nothing when both are present. Needs root (or sudo) and apt.
set -euo pipefail
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "[system-deps] need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[system-deps] no apt-get: install ${missing[*]} yourself (TCS_CHROMIUM may name a browser)" >&2
  exit 1
fi
echo "[system-deps] installing ${missing[*]} (Debian packages; a minute, once)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q "${missing[@]}" >/dev/null
