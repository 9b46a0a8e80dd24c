#!/usr/bin/env bash
# The test command (README, CI): builds the environment if needed, then runs every test on the
# default host, ComfyUI 0.33.0: unit tests of compile_core, integration tests against a real
# ComfyUI server, fleet tests against a real Redis, and browser tests against the real ComfyUI
# frontend. Then the host and browser tests run again on ComfyUI 0.3.75.
#   TCS_TEST_HOSTS="0.33.0"  only the default host (a space-separated list of hosts)
# Extra arguments pass through to pytest (for every host).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if ! bash scripts/install_system_deps.sh; then
  echo "[test] chromium/redis-server could not be installed; their tests will fail or skip" >&2
  [ -z "${CI:-}" ] || exit 1
fi
status=0
first=1
for host in ${TCS_TEST_HOSTS:-0.33.0 0.3.75}; do
  if [ $first = 1 ]; then paths=(tests); else paths=(tests/host tests/browser); fi
  echo "[test] ComfyUI $host: ${paths[*]}"
  # a private basetemp per host: pytest prunes /tmp/pytest-of-$USER across concurrent runs
  TCS_COMFY_HOST=$host .venv/bin/python -m pytest "${paths[@]}" \
    --basetemp="$PWD/.host/pytest-tmp-$host" "$@" || status=1
  first=0
done
exit $status
