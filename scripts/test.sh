#!/usr/bin/env bash
# The test command (README, CI): builds the environment if needed, then runs every test:
# unit tests of compile_core and integration tests against a real ComfyUI server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest tests "$@"
