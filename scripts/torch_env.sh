#!/usr/bin/env bash
# Builds the torch-matrix environment for one torch version: .venv-torch/<version>/, a venv with
#   that torch + the matching torchvision/torchaudio (pinned by constraints/torch-<version>.txt)
#   + ComfyUI 0.33's requirements (.host/requirements-0.33.0.txt, made by scripts/bootstrap.sh)
#   + requirements.txt + requirements-dev.txt.
# Usage: scripts/torch_env.sh <version>     (2.8.0, 2.9.1, 2.11.0, 2.13.0, 2.14.1, 2.15.0: one per constraints file)
#   2.13.0 is the main venv's torch: .venv-torch/2.13.0 is a symlink to .venv (no second copy).
#   2.8.0 / 2.9.1 are the CUDA builds from PyPI (~3 GB each with their nvidia-* wheels), 2.14.1
#   and 2.15.0 the CUDA builds from wherever pip is configured to look; all of them run on the CPU.
#   PIP_FIND_LINKS (a space-separated list) can point pip at pre-downloaded wheels.
# Idempotent: .venv-torch/<version>/.ready is written last; with it the script returns at once.
# Prints the venv's python path as the last line of its output.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VER=${1:?usage: scripts/torch_env.sh <torch version>}
CONS=$ROOT/constraints/torch-$VER.txt
[ -f "$CONS" ] || { echo "[torch_env] no $CONS: known versions: $(ls "$ROOT/constraints" | sed -n 's/^torch-\(.*\)\.txt$/\1/p' | tr '\n' ' ')" >&2; exit 2; }
VENV=$ROOT/.venv-torch/$VER
PY=${PYTHON:-python3}

bash scripts/bootstrap.sh
if [ "$VER" = "$(sed -n 's/^torch==//p' "$ROOT/constraints.txt")" ]; then
  mkdir -p "$ROOT/.venv-torch"
  [ -L "$VENV" ] || { rm -rf "$VENV"; ln -s ../.venv "$VENV"; }
  touch "$ROOT/.venv/.ready"
  echo "$VENV/bin/python"
  exit 0
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONS")
pipq() { "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2; }
if [ -f "$VENV/.ready" ] && [ -x "$VENV/bin/python" ]; then
  # the test tools as requirements-dev.txt lists them now (a venv built before a change gets them)
  if ! cmp -s "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"; then
    pipq -r "$ROOT/requirements-dev.txt"  # a failure stops here (set -e), with pip's message
    cp "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"
  fi
  for f in "$VENV"/lib/python3*/site-packages/_tcs_tv_shim.py; do  # keep a shim up to date
    if [ -f "$f" ] && ! cmp -s "$ROOT/tests/host/tv_shim.py" "$f"; then cp "$ROOT/tests/host/tv_shim.py" "$f"; fi
  done
  echo "$VENV/bin/python"
  exit 0
fi

t0=$SECONDS
echo "[torch_env] building $VENV (torch $VER; a few GB, several minutes)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
tv=$(sed -n 's/^torchvision==//p' "$CONS")
ta=$(sed -n 's/^torchaudio==//p' "$CONS")
pipq "torch==$VER"
# torchvision: the matching release; for a torch newer than the newest torchvision (its pin
# names an older torch), that torchvision without its deps
if ! pipq "torchvision==$tv"; then
  echo "[torch_env] torchvision $tv does not match torch $VER: installed without its deps" >&2
  pipq --no-deps "torchvision==$tv"
fi
# torchaudio: the matching release when PyPI has one (it requires torch==<same version>); for
# torch releases newer than the newest torchaudio, the newest torchaudio without its deps.
if [ "$ta" = "$VER" ]; then
  pipq "torchaudio==$ta"
else
  pipq --no-deps "torchaudio==$ta"
fi
pipq -r "$ROOT/.host/requirements-0.33.0.txt" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torchvision: the CUDA builds load their real ops on the CPU; the .pth shim (tests/host/tv_shim.py)
# is only installed where torchvision cannot import without it.
if ! "$VENV/bin/python" -c 'import torchvision' >/dev/null 2>&1; then
  echo "[torch_env] torchvision does not import as installed: adding the tv_shim .pth" >&2
  cp "$ROOT/tests/host/tv_shim.py" "$SITE/_tcs_tv_shim.py"
  echo "import _tcs_tv_shim" > "$SITE/_tcs_tv_shim.pth"
fi
# torchaudio built for another torch: its extension cannot load; its pure-torch parts (all that
# ComfyUI 0.33 calls at start-up) work without it.
if ! "$VENV/bin/python" -c 'import torchaudio' >/dev/null 2>&1; then
  echo "[torch_env] torchaudio does not import as installed: removing its native extension" >&2
  rm -f "$SITE"/torchaudio/lib/*.so
fi
"$VENV/bin/python" - "$VER" <<'PY' >&2
import sys
import torch, torchvision, torchaudio, safetensors, comfy_aimdo, gguf, pytest, xdist  # noqa: F401 - import check
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
print("[torch_env] torch", torch.__version__, "torchvision", torchvision.__version__,
      "torchaudio", torchaudio.__version__)
PY
cp "$ROOT/requirements-dev.txt" "$VENV/.requirements-dev.txt"
touch "$VENV/.ready"
echo "[torch_env] $VENV ready in $((SECONDS - t0))s" >&2
echo "$VENV/bin/python"
