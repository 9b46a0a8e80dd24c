"""compile_core.plan.paths: cache directories named by a workflow stay inside the allowed roots."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from compile_core.plan.paths import EXTRA_ROOTS_ENV, UnsafePathError, allowed_roots, resolve_cache_dir


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """user/ (the base and a root), temp/ (a second root) and outside/ (no root)."""
    monkeypatch.delenv(EXTRA_ROOTS_ENV, raising=False)
    d = {name: tmp_path / name for name in ("user", "temp", "outside")}
    for p in d.values():
        p.mkdir()
    d["roots"] = allowed_roots(d["user"], d["temp"])
    return d


def test_relative_path_lives_under_base(dirs):
    p = resolve_cache_dir("triton/kernels", dirs["user"], dirs["roots"])
    assert p == (dirs["user"] / "triton" / "kernels").resolve()


def test_empty_value_gives_a_default_under_base(dirs):
    for value in ("", "   ", None):
        p = resolve_cache_dir(value, dirs["user"], dirs["roots"])
        assert dirs["user"].resolve() in p.parents


def test_dotdot_that_stays_inside_is_allowed(dirs):
    p = resolve_cache_dir("a/../b", dirs["user"], dirs["roots"])
    assert p == (dirs["user"] / "b").resolve()


@pytest.mark.parametrize("value", ["..", "../outside", "../../..", "a/../../outside/x",
                                   "../user2", "../user-evil/x"])
def test_dotdot_escaping_is_refused(dirs, value):
    with pytest.raises(UnsafePathError) as info:
        resolve_cache_dir(value, dirs["user"], dirs["roots"])
    msg = str(info.value)
    assert "ptx_cache_dir" in msg and EXTRA_ROOTS_ENV in msg


def test_sibling_with_a_common_prefix_is_not_inside(tmp_path, dirs):
    (tmp_path / "user2").mkdir()
    with pytest.raises(UnsafePathError):
        resolve_cache_dir(str(tmp_path / "user2"), dirs["user"], dirs["roots"])


@pytest.mark.parametrize("value", ["/etc", "/", "/tmp"])
def test_absolute_path_outside_is_refused(dirs, value):
    with pytest.raises(UnsafePathError, match="outside the allowed cache roots"):
        resolve_cache_dir(value, dirs["user"], dirs["roots"])


def test_absolute_path_outside_tmp_dir_is_refused(dirs):
    with pytest.raises(UnsafePathError):
        resolve_cache_dir(str(dirs["outside"] / "cache"), dirs["user"], dirs["roots"])


def test_absolute_path_inside_a_root_is_allowed(dirs):
    target = dirs["temp"] / "kernels"
    assert resolve_cache_dir(str(target), dirs["user"], dirs["roots"]) == target.resolve()
    assert resolve_cache_dir(str(dirs["temp"]), dirs["user"], dirs["roots"]) == dirs["temp"].resolve()


def test_symlink_inside_the_root_pointing_outside_is_refused(dirs):
    link = dirs["user"] / "escape"
    link.symlink_to(dirs["outside"], target_is_directory=True)
    with pytest.raises(UnsafePathError):
        resolve_cache_dir("escape", dirs["user"], dirs["roots"])
    with pytest.raises(UnsafePathError):
        resolve_cache_dir("escape/deeper/cache", dirs["user"], dirs["roots"])
    with pytest.raises(UnsafePathError):
        resolve_cache_dir(str(link / "cache"), dirs["user"], dirs["roots"])


def test_symlink_inside_the_root_pointing_into_another_root_is_allowed(dirs):
    link = dirs["user"] / "to_temp"
    link.symlink_to(dirs["temp"], target_is_directory=True)
    assert resolve_cache_dir("to_temp/k", dirs["user"], dirs["roots"]) == (dirs["temp"] / "k").resolve()


def test_root_that_is_a_symlink_is_resolved(tmp_path, monkeypatch):
    monkeypatch.delenv(EXTRA_ROOTS_ENV, raising=False)
    real = tmp_path / "real_user"
    real.mkdir()
    alias = tmp_path / "alias_user"
    alias.symlink_to(real, target_is_directory=True)
    roots = allowed_roots(alias)
    assert roots == [real.resolve()]
    assert resolve_cache_dir("triton", alias, roots) == (real / "triton").resolve()


def test_home_expansion_is_checked_too(dirs, monkeypatch):
    monkeypatch.setenv("HOME", str(dirs["outside"]))
    with pytest.raises(UnsafePathError):
        resolve_cache_dir("~/cache", dirs["user"], dirs["roots"])
    monkeypatch.setenv("HOME", str(dirs["temp"]))
    assert resolve_cache_dir("~/cache", dirs["user"], dirs["roots"]) == (dirs["temp"] / "cache").resolve()


def test_extra_roots_env_adds_roots(dirs, tmp_path, monkeypatch):
    extra1, extra2 = tmp_path / "extra1", tmp_path / "extra2"
    extra1.mkdir()
    extra2.mkdir()
    target = extra2 / "cache"
    with pytest.raises(UnsafePathError):
        resolve_cache_dir(str(target), dirs["user"], allowed_roots(dirs["user"]))
    monkeypatch.setenv(EXTRA_ROOTS_ENV, os.pathsep.join(["", str(extra1), str(extra2), ""]))
    roots = allowed_roots(dirs["user"])
    assert roots == [dirs["user"].resolve(), extra1.resolve(), extra2.resolve()]
    assert resolve_cache_dir(str(target), dirs["user"], roots) == target.resolve()
    with pytest.raises(UnsafePathError):  # the others stay refused
        resolve_cache_dir(str(dirs["outside"]), dirs["user"], roots)


def test_custom_key_is_named_in_the_error(dirs):
    with pytest.raises(UnsafePathError, match="inductor_cache_dir"):
        resolve_cache_dir("/etc", dirs["user"], dirs["roots"], key="inductor_cache_dir")


def test_no_roots_refuses_everything(dirs):
    with pytest.raises(UnsafePathError):
        resolve_cache_dir("triton", dirs["user"], [])


def test_unsafe_path_error_is_a_value_error():
    assert issubclass(UnsafePathError, ValueError)


def test_resolve_does_not_create_directories(dirs):
    p = resolve_cache_dir("not/yet/there", dirs["user"], dirs["roots"])
    assert not p.exists() and isinstance(p, Path)


# --------------------------------------------------------------------------- workflow paths
# A workflow may only name a folder under <user dir>/torch_compile_speed/ or an operator root:
# ComfyUI's temp/, input/ and output/ take uploads (/upload/image), and Triton loads any .so
# found under its cache key, so a cache folder there lets an upload load native code.

import compile_core.plan.paths as paths_mod  # noqa: E402 - new names are looked up per test


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A ComfyUI-like layout: user/ (with the pack's folder), temp/, input/, output/, outside/."""
    monkeypatch.delenv(EXTRA_ROOTS_ENV, raising=False)
    d = {name: tmp_path / name for name in ("user", "temp", "input", "output", "outside")}
    for p in d.values():
        p.mkdir()
    (d["user"] / "torch_compile_speed").mkdir()
    (d["user"] / "default").mkdir()  # ComfyUI's /userdata API writes here
    d["pack"] = (d["user"] / "torch_compile_speed").resolve()
    return d


def test_workflow_relative_paths_live_in_the_pack_folder(comfy):
    resolve = paths_mod.resolve_workflow_cache_dir
    assert resolve("kernels", comfy["user"]) == comfy["pack"] / "kernels"
    assert resolve("a/../b", comfy["user"]) == comfy["pack"] / "b"
    for empty in ("", "  ", None):
        assert resolve(empty, comfy["user"]) == comfy["pack"] / "triton"
    assert resolve(str(comfy["pack"] / "abs"), comfy["user"]) == comfy["pack"] / "abs"
    assert resolve(str(comfy["pack"]), comfy["user"]) == comfy["pack"]


def test_workflow_roots_are_the_pack_folder_and_the_operator_roots(comfy, tmp_path, monkeypatch):
    assert paths_mod.workflow_roots(comfy["user"]) == [comfy["pack"]]
    op = tmp_path / "operator"
    op.mkdir()
    monkeypatch.setenv(EXTRA_ROOTS_ENV, str(op))
    assert paths_mod.workflow_roots(comfy["user"]) == [comfy["pack"], op.resolve()]
    assert paths_mod.resolve_workflow_cache_dir(str(op / "k"), comfy["user"]) == op.resolve() / "k"


@pytest.mark.parametrize("where", ["temp", "input", "output", "outside", "user", "user/default"])
def test_workflow_absolute_paths_outside_the_pack_folder_are_refused(comfy, where):
    target = comfy["user"].parent / where / "triton"
    with pytest.raises(UnsafePathError) as info:
        paths_mod.resolve_workflow_cache_dir(str(target), comfy["user"])
    msg = str(info.value)
    assert "ptx_cache_dir" in msg and "outside the allowed cache roots" in msg
    assert str(comfy["pack"]) in msg and EXTRA_ROOTS_ENV in msg  # names the roots and the way out


@pytest.mark.parametrize("value", ["../../temp/triton", "../../input/k", "../../output", "..",
                                   "../default/x", "../../outside", "../torch_compile_speed_evil",
                                   "/etc/tcs", "/tmp/tcs", "~/tcs"])
def test_workflow_escapes_are_refused(comfy, value, monkeypatch):
    monkeypatch.setenv("HOME", str(comfy["temp"]))
    with pytest.raises(UnsafePathError, match="outside the allowed cache roots"):
        paths_mod.resolve_workflow_cache_dir(value, comfy["user"])


def test_workflow_symlink_out_of_the_pack_folder_is_refused(comfy):
    (comfy["pack"] / "to_input").symlink_to(comfy["input"], target_is_directory=True)
    for value in ("to_input", "to_input/triton", str(comfy["pack"] / "to_input" / "x")):
        with pytest.raises(UnsafePathError):
            paths_mod.resolve_workflow_cache_dir(value, comfy["user"])


def test_workflow_unresolvable_values_are_unsafe_path_errors(comfy):
    loop = comfy["pack"] / "loop"
    loop.symlink_to(loop)
    for value in ("bad\0name", "loop/x"):
        with pytest.raises(UnsafePathError):
            paths_mod.resolve_workflow_cache_dir(value, comfy["user"])


class _Reached(Exception):
    """The fake bridge's model access: the path check let the value through."""


@pytest.fixture
def apply_with_fake_bridge(pack, comfy, monkeypatch):
    """ApplyTorchCompile.apply with a stand-in for nodes/comfy_bridge (ComfyUI's folders are
    ``comfy``'s); it stops with _Reached at the first model access, after the path check."""
    import types
    from compile_core.plan.settings import build_compile_args
    bridge = types.SimpleNamespace(
        user_directory=lambda: str(comfy["user"]), temp_directory=lambda: str(comfy["temp"]),
        diffusion_model=lambda model: (_ for _ in ()).throw(_Reached()))
    nodes_pkg = sys.modules[pack.__name__ + ".nodes"]
    monkeypatch.setitem(sys.modules, pack.__name__ + ".nodes.comfy_bridge", bridge)
    monkeypatch.setattr(nodes_pkg, "comfy_bridge", bridge, raising=False)
    node = pack.NODE_CLASS_MAPPINGS["ApplyTorchCompile"]()

    def apply(value):
        args = build_compile_args(mode="default", experimental_ptx=True, ptx_cache_dir=value)
        return node.apply(object(), args)
    return apply


@pytest.mark.parametrize("where", ["temp", "input", "output", "user/default"])
def test_apply_node_refuses_a_ptx_cache_dir_in_comfyui_upload_folders(apply_with_fake_bridge,
                                                                       comfy, where):
    """temp/input/output take /upload/image; user/default takes ComfyUI's /userdata API."""
    top = comfy["user"].parent
    for value in (str(top / where / "triton"), f"../../{where}/triton", f"../{where}/triton"):
        with pytest.raises(ValueError, match="ptx_cache_dir") as info:  # the pack's own class
            apply_with_fake_bridge(value)
        assert type(info.value).__name__ == "UnsafePathError"
    assert not any((top / where).iterdir())


def test_apply_node_accepts_the_pack_folder(apply_with_fake_bridge, comfy):
    for value in ("", "mine", str(comfy["pack"] / "abs")):
        with pytest.raises(_Reached):
            apply_with_fake_bridge(value)
