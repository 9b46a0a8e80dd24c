#!/usr/bin/env bash
# Model zoo: every diffusion model class of the test host's ComfyUI (TCS_COMFY_HOST, 0.33.0 by
# default), tiny with random weights on CPU, run eagerly and through the pack's engine at two
# latent sizes. Writes benchmarks/results/model_zoo.{json,md}; see tests/host/regions/model_zoo.py.
#   scripts/model_zoo.sh [--backend inductor|aot_eager] [--cases lumina2,pixart]
# With --cases only those rows of the table are re-run (the others are kept from the last run with
# the same backend, mode, ComfyUI and torch).
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=aot_eager
ARGS=()
MERGE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND=$2; shift 2 ;;
    --cases) MERGE=(--merge); ARGS+=("$1" "$2"); shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
export TCS_ZOO_SCRIPT="scripts/model_zoo.sh --backend $BACKEND"
exec .venv/bin/python tests/host/regions/model_zoo.py --backend "$BACKEND" --mode default \
  --json benchmarks/results/model_zoo.json --md benchmarks/results/model_zoo.md ${MERGE[@]+"${MERGE[@]}"} ${ARGS[@]+"${ARGS[@]}"}
