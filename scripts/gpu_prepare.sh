#!/usr/bin/env bash
# The first step of the GPU checks, run on a machine with the development environment
# (scripts/bootstrap.sh's .host/comfyui-0.33.0 and .venv). It builds .gpu/ (git-ignored), a
# bundle that lets the checks run on a CUDA machine with no package index:
#   .gpu/wheels/          scripts/gpu_requirements.txt as Python 3.12 manylinux wheels
#   .gpu/kitchen/         comfy-kitchen's Python code (without its native libraries, 58 MB)
#   .gpu/ComfyUI-GGUF/    ComfyUI-GGUF's code, for the GPU matrix's GGUF rows (gguf: a wheel above)
#   .gpu/comfyui-0.33.0/  the default test host without its tests, caches and examples, with a
#                         tcs_host.json whose front_end_root is a stub page (no frontend wheel)
# Then copy the repository with .gpu to the CUDA machine and run, from its root:
#   bash scripts/gpu_session.sh check
# The bundle is kept small (the repository with .gpu under 62 MiB) so that it is quick to copy;
# the script prints the size and fails above that.
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=.host/comfyui-0.33.0
KITCHEN=0.2.31  # ComfyUI 0.33.0's pin (its requirements.txt)
[ -d "$HOST" ] || { echo "[gpu_prepare] $HOST is missing: run scripts/bootstrap.sh first" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/wheels
.venv/bin/python -m pip download --quiet --only-binary=:all: --no-deps --implementation cp \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gpu/wheels -r scripts/gpu_requirements.txt
# comfy-kitchen (ComfyUI 0.33 imports it unconditionally) without its native CUDA and HIP
# libraries (58 MB): its Triton and eager backends stand in, which it reports (gpu_session setup)
kitchen=$(mktemp -d)
.venv/bin/python -m pip download --quiet --only-binary=:all: --no-deps --implementation cp \
  --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$kitchen" "comfy-kitchen==$KITCHEN"
.venv/bin/python - "$kitchen"/comfy_kitchen-*.whl .gpu/kitchen <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])
PY
rm -rf "$kitchen"
.venv/bin/python - "$HOST" .gpu/comfyui-0.33.0 <<'PY'
import json, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
TOP = {"tests", "tests-unit", ".github", ".ci", "script_examples", "custom_nodes", "input", "output",
       "models", "user", "temp", "tcs_host.json"}  # (only at the top: comfy/ldm/models is code)


TOP |= {"blueprints"}  # (optional: ComfyUI loads them only where the folder exists)


def skip(folder, names):
    """Caches, the top-level folders above, and tokenizer data (read when a text encoder is
    built: the tests and the benchmark build none)."""
    top = Path(folder) == src
    return {n for n in names if n == "__pycache__" or n.endswith(".pyc") or (top and n in TOP)
            or (n.endswith("_tokenizer") and _data_only(Path(folder) / n))}


def _data_only(path):
    return path.is_dir() and not any(path.rglob("*.py"))


shutil.copytree(src, dst, ignore=skip)
for sub in ("custom_nodes", "input", "output", "models"):
    (dst / sub).mkdir(exist_ok=True)
stub = dst / "tcs_stub_frontend"
stub.mkdir()
(stub / "index.html").write_text("<!doctype html><title>ComfyUI (TorchCompileSpeed GPU run: no frontend)</title>\n")
cfg = json.loads((src / "tcs_host.json").read_text()) if (src / "tcs_host.json").is_file() else {}
cfg.update(front_end_root=stub.name, gpu_copy=True)  # (the server runs in the host folder)
(dst / "tcs_host.json").write_text(json.dumps(cfg, indent=1) + "\n")
PY
cp -r .host/ComfyUI-GGUF .gpu/ComfyUI-GGUF && rm -rf .gpu/ComfyUI-GGUF/tools
du -sh .gpu/wheels .gpu/kitchen .gpu/comfyui-0.33.0 .gpu/ComfyUI-GGUF
total=$(( $(du -sb .gpu | cut -f1) + $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) ))
echo "[gpu_prepare] the repository with .gpu: about $((total / 1048576)) MiB (limit 62)"
[ $total -lt $((62 * 1048576)) ] || { echo "[gpu_prepare] the bundle is too large" >&2; exit 1; }
echo "[gpu_prepare] done; copy the repository with .gpu to the CUDA machine and run there:"
echo "[gpu_prepare]   bash scripts/gpu_session.sh check"
