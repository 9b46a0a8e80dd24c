#!/usr/bin/env bash
# The test command (README, CI): builds the environment if needed, then runs every test:
# unit tests of compile_core, integration tests against a real ComfyUI server, fleet tests
# against a real Redis, and browser tests against the real ComfyUI frontend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if ! bash scripts/install_system_deps.sh; then
  echo "[test] chromium/redis-server could not be installed; their tests will fail or skip" >&2
  [ -z "${CI:-}" ] || exit 1
fi
# a private basetemp: pytest prunes /tmp/pytest-of-$USER across concurrent runs
exec .venv/bin/python -m pytest tests --basetemp="$PWD/.host/pytest-tmp" "$@"
