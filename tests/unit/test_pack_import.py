"""Importing compile_core (torch alone) and the whole pack (as ComfyUI does) without ComfyUI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_NAMES = {"TorchCompileSpeedSettings": "Torch Compile Speed Settings",
              "ApplyTorchCompile": "Apply Torch Compile"}


def run_clean(code: str, tmp_path: Path) -> dict:
    """Run ``code`` in a fresh interpreter from the repo root with a minimal environment
    (no PYTHONPATH, no user site); it prints one JSON line, which is returned."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([sys.executable, "-E", "-s", "-c", textwrap.dedent(code)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


COMMON = """
import importlib.util, json, sys
def comfy_loaded():
    return sorted(m for m in sys.modules if m == "comfy" or m.startswith(("comfy.", "comfy_"))
                  or m in ("folder_paths", "server", "nodes", "execution"))
"""


def test_compile_core_imports_with_torch_alone(tmp_path):
    out = run_clean(COMMON + """
import pkgutil, compile_core
names = sorted(m.name for m in pkgutil.walk_packages(compile_core.__path__, "compile_core."))
for name in names:
    importlib.import_module(name)
names = [name.rsplit(".", 1)[1] for name in names]
print(json.dumps({"modules": names, "comfy": comfy_loaded(),
                  "comfy_importable": importlib.util.find_spec("comfy") is not None,
                  "torch": "torch" in sys.modules, "file": compile_core.__file__}))
""", tmp_path)
    assert out["comfy_importable"] is False  # no ComfyUI on this interpreter's path
    assert out["comfy"] == []
    assert out["torch"] is True
    assert Path(out["file"]).resolve().parent == REPO_ROOT / "compile_core"
    assert {"engine", "fallback", "fingerprint", "log", "paths", "regions", "registry", "scoped",
            "settings", "warmup"} <= set(out["modules"])


def test_pack_imports_as_a_package_without_comfyui(tmp_path):
    out = run_clean(COMMON + f"""
root = {str(REPO_ROOT)!r}
spec = importlib.util.spec_from_file_location("TorchCompileSpeed", root + "/__init__.py",
                                              submodule_search_locations=[root])
pack = importlib.util.module_from_spec(spec)
sys.modules["TorchCompileSpeed"] = pack
spec.loader.exec_module(pack)
print(json.dumps({{"classes": sorted(pack.NODE_CLASS_MAPPINGS),
                  "display": pack.NODE_DISPLAY_NAME_MAPPINGS, "web": pack.WEB_DIRECTORY,
                  "comfy": comfy_loaded(),
                  "comfy_importable": importlib.util.find_spec("comfy") is not None,
                  "bridge_loaded": "TorchCompileSpeed.nodes.comfy_bridge" in sys.modules}}))
""", tmp_path)
    assert out["comfy_importable"] is False
    assert set(NODE_NAMES) <= set(out["classes"])
    assert out["display"].items() >= NODE_NAMES.items()
    assert set(out["display"]) == set(out["classes"])
    assert out["web"] == "./web/js"
    assert out["comfy"] == []
    assert out["bridge_loaded"] is False  # ComfyUI internals load lazily, at apply time


def test_pack_fixture_exposes_the_mappings(pack):
    assert pack.__name__ == "TorchCompileSpeed"
    assert set(NODE_NAMES) <= set(pack.NODE_CLASS_MAPPINGS)
    assert pack.NODE_DISPLAY_NAME_MAPPINGS.items() >= NODE_NAMES.items()
    assert set(pack.NODE_DISPLAY_NAME_MAPPINGS) == set(pack.NODE_CLASS_MAPPINGS)
    assert (REPO_ROOT / pack.WEB_DIRECTORY).is_dir()
    assert set(pack.__all__) >= {"NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"}


@pytest.mark.parametrize("name", sorted(NODE_NAMES))
def test_nodes_follow_the_comfyui_node_contract(pack, name):
    cls = pack.NODE_CLASS_MAPPINGS[name]
    spec = cls.INPUT_TYPES()
    assert "required" in spec
    assert cls.CATEGORY == "optimization"
    assert isinstance(cls.RETURN_TYPES, tuple) and len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES)
    assert callable(getattr(cls(), cls.FUNCTION))
    assert isinstance(cls.DESCRIPTION, str) and cls.DESCRIPTION


def test_apply_node_inputs_and_output(pack):
    cls = pack.NODE_CLASS_MAPPINGS["ApplyTorchCompile"]
    required = cls.INPUT_TYPES()["required"]
    assert list(required) == ["model", "compile_args"]
    assert required["model"][0] == "MODEL"
    assert required["compile_args"][0] == "WANCOMPILEARGS"
    assert cls.RETURN_TYPES == ("MODEL",) and cls.RETURN_NAMES == ("model",)

