#!/usr/bin/env bash
# The demo command (README): a ComfyUI host, a tiny WAN model, eager vs compiled timings.
# In a clone inside a ComfyUI's custom_nodes folder it runs on that ComfyUI, with the Python
# that runs it (PYTHON, default python3); elsewhere on the local host that bootstrap builds.
set -euo pipefail
cd "$(dirname "$0")/.."
comfy=$(cd .. && cd .. && pwd)
if [ "$(basename "$(dirname "$PWD")")" = custom_nodes ] && [ -f "$comfy/main.py" ] && [ -d "$comfy/comfy" ]; then
  py=${PYTHON:-python3}
  echo "[demo] on the ComfyUI in $comfy, with $py"
  TCS_COMFY_HOST="$comfy" TCS_PYTHON="$py" exec "$py" scripts/demo.py "$@"
fi
bash scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
