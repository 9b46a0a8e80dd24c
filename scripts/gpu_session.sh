#!/usr/bin/env bash
# The GPU checks, on a Linux machine with an NVIDIA GPU and Python 3.12 with CUDA torch and Triton,
# from the repo root, with the .gpu bundle that scripts/gpu_prepare.sh builds (it needs no network):
#   bash scripts/gpu_session.sh setup        the bundle's wheels into .gpu-run/site; prints the GPU,
#                                            torch, Triton and comfy-aimdo it found
#   bash scripts/gpu_session.sh check        the whole check in about 8 minutes (benchmarks/gpu_check.py):
#                                            GPU tests, a ComfyUI 0.33 server with and without dynamic
#                                            VRAM, the speed benchmark at the real size; writes
#                                            gpu_check.json / .md (commit them to benchmarks/results)
#   bash scripts/gpu_session.sh matrix       the GPU matrix (benchmarks/gpu_matrix.py, rows A1,B,F,L,C1,C2,G8,P,
#                                            each under its own limit; about 8 minutes): writes
#                                            gpu_matrix.json / .md (commit them to benchmarks/results)
#   bash scripts/gpu_session.sh tests        tests/gpu alone
#   bash scripts/gpu_session.sh bench-small  benchmarks/gpu_wan_bf16.py --small (33 frames 240x416)
#   bash scripts/gpu_session.sh bench        benchmarks/gpu_wan_bf16.py (81 frames 480x832)
# Every stage runs setup first if it has not run on this machine. Results go to $OUT, or
# .gpu-run/out when OUT is unset.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-.gpu-run/out}
mkdir -p "$OUT"
SITE="$PWD/.gpu-run/site"
export PYTHONPATH="$SITE:$PWD/.gpu/kitchen${PYTHONPATH:+:$PYTHONPATH}"
export TCS_COMFY_HOST="$PWD/.gpu/comfyui-0.33.0"
[ -d "$TCS_COMFY_HOST" ] || { echo "[gpu] .gpu is missing: run scripts/gpu_prepare.sh on a machine with the development environment, then copy .gpu here" >&2; exit 2; }

setup() {
  if [ ! -f "$SITE/.done" ]; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" .gpu/wheels/*.whl || return 1
    touch "$SITE/.done"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - <<'PY'
import importlib, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("triton", "comfy_aimdo", "torchsde", "sqlalchemy", "comfy_kitchen", "av"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "imported"))
    except Exception as exc:  # noqa: BLE001 - a report
        print(name, "MISSING:", type(exc).__name__, exc)
try:
    import comfy_kitchen
    print("comfy_kitchen backends:", {k: v["available"] for k, v in comfy_kitchen.list_backends().items()})
except Exception as exc:  # noqa: BLE001 - a report
    print("comfy_kitchen backends: ?", exc)
PY
}

stage=${1:-setup}
setup > "$OUT/setup.txt" 2>&1; rc=$?
cat "$OUT/setup.txt"
[ $rc = 0 ] || exit $rc
case "$stage" in
  setup) ;;
  tests)
    "$PY" -m pytest tests/gpu -v -rA -p no:cacheprovider --basetemp="$PWD/.gpu-run/pytest" \
      --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
    rc=${PIPESTATUS[0]} ;;
  check)
    "$PY" benchmarks/gpu_check.py --out-dir "$OUT" "${@:2}" 2>&1 | tee "$OUT/check.txt"
    rc=${PIPESTATUS[0]}
    # the logs as one file beside the results
    tar czf "$OUT/gpu_check_logs.tar.gz" -C "$OUT" gpu_check_logs && rm -rf "$OUT/gpu_check_logs" ;;
  matrix)
    "$PY" benchmarks/gpu_matrix.py --out-dir "$OUT" "${@:2}" 2>&1 | tee "$OUT/matrix.txt"
    rc=${PIPESTATUS[0]} ;;
  bench-small|bench)
    flag=(); [ "$stage" = bench-small ] && flag=(--small)
    "$PY" benchmarks/gpu_wan_bf16.py "${flag[@]}" --out "$OUT/gpu_results${flag:+_small}" 2>&1 | tee "$OUT/$stage.txt"
    rc=${PIPESTATUS[0]} ;;
  *) echo "[gpu] unknown stage: $stage (setup, check, matrix, tests, bench-small, bench)" >&2; rc=2 ;;
esac
exit $rc
