#!/usr/bin/env bash
# The demo command (README): a local ComfyUI host, a tiny WAN model, eager vs compiled timings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
