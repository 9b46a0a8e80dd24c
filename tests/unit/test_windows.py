"""The pack's Windows branches, run on this Linux machine with named fakes.

- ``fake_windows``: ``sys.platform`` is ``"win32"``, and so is torch's import-time switch
  ``cpp_builder._IS_WINDOWS`` (torch reads ``sys.platform`` once, at import). ``os.name`` is
  left alone: pathlib picks ``WindowsPath`` from it, which cannot be made on Linux.
- ``fake_winreg``: a ``winreg`` module answering the LongPathsEnabled value (or raising).
- ``fake_msvc``: a shell script named ``cl`` on PATH that answers ``/help`` with MSVC's banner
  on stderr and, like MSVC, fails on ``--version``.

Path lengths are real: files are created at the depths the pack plans for and measured.
"""
from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path

import pytest
import torch
from torch._inductor import cpp_builder

from compile_core.diagnose import diagnostics
from compile_core.cache import fleet_entries, persist
from compile_core.report import log
from compile_core.torch_support import longpaths
from compile_core.plan import preflight as pf
from compile_core.run import warmup
from compile_core.cache.persist import PersistentCache
from test_preflight import settings  # the same inductor settings the preflight tests use

CPU = torch.device("cpu")
BANNER = "Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35207 for x64"
MSVC_SCRIPT = f"""#!/bin/sh
# FAKE MSVC cl: the banner goes to stderr; --version is an unknown option and no source is given
echo "{BANNER}" >&2
echo "Copyright (C) Microsoft Corporation.  All rights reserved." >&2
for arg in "$@"; do
  if [ "$arg" = "--version" ]; then
    echo "cl : Command line warning D9002 : ignoring unknown option '--version'" >&2
    echo "cl : Command line error D8003 : missing source filename" >&2
    exit 2
  fi
done
echo "                         C/C++ COMPILER OPTIONS"
exit 0
"""


def _clear_compiler_caches():
    pf._cpp_compiler_problem.cache_clear()
    fleet_entries._cpu_identity.cache_clear()
    for name in ("check_compiler_exist_windows", "check_msvc_cl_language_id", "_is_msvc_cl",
                 "cpp_compiler_search"):
        clear = getattr(getattr(cpp_builder, name, None), "cache_clear", None)  # faked, or absent (2.8)
        if clear:
            clear()


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(log, "_said", set())


@pytest.fixture
def fake_windows(monkeypatch, fresh_warnings):
    """FAKE Windows: sys.platform and torch's own platform switch say win32."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(cpp_builder, "_IS_WINDOWS", True)
    _clear_compiler_caches()
    yield
    _clear_compiler_caches()


@pytest.fixture
def fake_winreg(monkeypatch):
    """FAKE winreg: ``fake_winreg.value`` is LongPathsEnabled (None: the value is missing)."""
    ns = types.SimpleNamespace(value=0, asked=[])

    class Key:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def open_key(root, path):
        ns.asked.append((root, path))
        return Key()

    def query(key, name):
        if ns.value is None:
            raise FileNotFoundError(2, "The system cannot find the file specified")
        return ns.value, 4  # REG_DWORD

    module = types.ModuleType("winreg")
    module.HKEY_LOCAL_MACHINE = "HKLM"
    module.OpenKey, module.QueryValueEx = open_key, query
    monkeypatch.setitem(sys.modules, "winreg", module)
    return ns


@pytest.fixture
def fake_msvc(tmp_path, monkeypatch):
    """FAKE MSVC: ``cl`` alone on PATH; CXX/CC unset (torch's Windows default is ``cl``)."""
    bin_dir = tmp_path / "msvc-bin"
    bin_dir.mkdir()
    script = bin_dir / "cl"
    script.write_text(MSVC_SCRIPT)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    return script


@pytest.fixture
def short_dir():
    """A folder with a short path (tmp_path is too deep to leave room under 260 characters)."""
    path = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- MSVC

def test_fake_msvc_behaves_like_cl(fake_msvc):
    """The fake fails ``--version`` (the probe the pack used before) and answers ``/help``."""
    version = subprocess.run(["cl", "--version"], capture_output=True, text=True)
    assert version.returncode != 0 and BANNER in version.stderr and version.stdout == ""
    assert subprocess.run(["cl", "/help"], capture_output=True).returncode == 0


def test_msvc_is_accepted_as_torch_detects_it(fake_windows, fake_msvc):
    assert cpp_builder.get_cpp_compiler() == "cl"  # torch's own Windows search
    assert pf.cpp_compiler_problem() == ""
    s = settings()
    checked, findings = pf.preflight(s, CPU, {torch.float32})
    assert checked is s and findings == []


def test_msvc_is_accepted_by_the_pack_probe_when_torch_does_not_say(fake_windows, fake_msvc,
                                                                     monkeypatch):
    monkeypatch.setattr(cpp_builder, "_is_msvc_cl", lambda compiler: False)
    assert pf._msvc_problem("cl") == ""


def test_no_cl_on_windows_says_build_tools_not_apt_get(fake_windows, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cl anywhere
    monkeypatch.delenv("CXX", raising=False)
    checked, findings = pf.preflight(settings(), CPU, {torch.float32})
    assert checked is None and [f.check for f in findings] == ["cpp-compiler"]
    msg = findings[0].message
    assert "no C++ compiler found" in msg, msg
    assert "Visual Studio Build Tools" in msg and "Desktop development with C++" in msg
    assert "x64 Native Tools Command Prompt" in msg and "vcvars64.bat" in msg
    assert "apt-get" not in msg and "g++" not in msg and "eager" in msg


def test_a_broken_cl_is_reported(fake_windows, fake_msvc):
    fake_msvc.write_text("#!/bin/sh\necho 'cl: cannot start' >&2\nexit 1\n")
    problem = pf.cpp_compiler_problem()
    assert "fails (exit 1)" in problem, problem


def test_compiler_check_follows_path_changes(fake_windows, fake_msvc, tmp_path, monkeypatch):
    """Starting from a Visual Studio prompt puts cl on PATH: the cached answer follows PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert pf.cpp_compiler_problem()
    cpp_builder.check_compiler_exist_windows.cache_clear()  # torch caches its own probe
    monkeypatch.setenv("PATH", str(fake_msvc.parent))
    assert pf.cpp_compiler_problem() == ""


def test_compiler_banner_and_fleet_identity_use_the_msvc_banner(fake_windows, fake_msvc):
    assert pf.compiler_banner("cl") == BANNER
    with_msvc = fleet_entries._cpu_identity()
    fake_msvc.write_text(MSVC_SCRIPT.replace("19.44.35207", "19.29.30159"))
    fleet_entries._cpu_identity.cache_clear()
    assert fleet_entries._cpu_identity() != with_msvc  # another MSVC builds other kernels


# --------------------------------------------------------------------------- long paths: facts

@pytest.mark.parametrize("value, enabled", [(1, True), (0, False), (None, False)])
def test_long_paths_registry_value(fake_winreg, value, enabled):
    fake_winreg.value = value
    assert longpaths.long_paths_enabled() is enabled
    assert fake_winreg.asked == [("HKLM", r"SYSTEM\CurrentControlSet\Control\FileSystem")]


def test_no_winreg_means_no_long_paths(monkeypatch):
    monkeypatch.setitem(sys.modules, "winreg", None)  # import winreg raises ImportError
    assert longpaths.long_paths_enabled() is False


def test_path_limit_only_on_windows_without_long_paths(fake_winreg, monkeypatch):
    assert longpaths.path_limit() is None  # Linux: no limit, whatever the registry says
    monkeypatch.setattr(sys, "platform", "win32")
    assert longpaths.path_limit() == 259
    fake_winreg.value = 1
    assert longpaths.path_limit() is None


def _kernel_name() -> str:
    name = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_view_"
    return (name + "x" * longpaths.KERNEL_NAME)[:longpaths.KERNEL_NAME]


def test_deepest_path_is_what_triton_really_writes(tmp_path):
    """Make Triton's deepest file (its temp copy of a group file) in a real entry and measure."""
    cache = PersistentCache(tmp_path / "cache")
    key = base64.b32encode(hashlib.sha256(b"kernel").digest()).decode().rstrip("=")
    tmp = f"tmp.pid_{'9' * longpaths.PID}_{uuid.uuid4()}"
    deepest = (cache.inductor_dir("f" * 24) / persist.TRITON_SUBDIR / key / tmp
               / f"__grp__{_kernel_name()}.json")
    deepest.parent.mkdir(parents=True)
    deepest.write_text("{}")
    assert len(key) == longpaths.KEY
    assert len(str(deepest)) == persist.deepest_path(cache.root)
    fx = cache.inductor_dir("f" * 24) / "aotautograd" / key / key  # torch's deepest own file
    assert len(str(fx)) < len(str(deepest))


def test_worst_case_lengths_for_a_portable_install():
    """The numbers behind docs/caches-and-fleet.md (Windows): a portable build in Downloads is
    past the limit, the pack's short root is not (a 10-character user name)."""
    below = len(r"\0123456789abcdef\inductor\t") + longpaths.below_triton_dir()
    downloads = r"C:\Users\0123456789\Downloads\ComfyUI_windows_portable\ComfyUI\user" \
                r"\torch_compile_speed\cache"
    short = r"C:\Users\0123456789\AppData\Local\tcs"
    assert len(downloads) + below == 305 > longpaths.LIMIT
    assert len(short) + below == 249 <= longpaths.LIMIT
    before = len(r"\0123456789abcdef01234567\inductor\triton") + longpaths.below_triton_dir()
    assert len(downloads) + before == 318  # 24-hex entries and a "triton" folder


# --------------------------------------------------------------------------- long paths: the cache root

def test_a_deep_default_root_moves_to_localappdata_and_says_why_once(
        fake_windows, fake_winreg, tmp_path, short_dir, monkeypatch, pack_log):
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    monkeypatch.setenv("LOCALAPPDATA", str(short_dir))
    user = tmp_path / ("u" * 40)
    assert persist.deepest_path(user / "torch_compile_speed" / "cache") > 259
    cache = PersistentCache.default(user)
    assert cache.root == short_dir / "tcs"
    assert persist.deepest_path(cache.root) <= 259
    assert PersistentCache.default(user).root == short_dir / "tcs"
    moved = [m for m in pack_log.infos() if "instead of" in m]
    assert len(moved) == 1 and "260" in moved[0] and "long paths" in moved[0], pack_log.infos()
    env = cache.env("f" * 24)  # the moved cache works
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_dir()
    assert pack_log.warnings() == []


def test_long_paths_enabled_keeps_the_default_root(fake_windows, fake_winreg, tmp_path, monkeypatch):
    fake_winreg.value = 1
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    user = tmp_path / ("u" * 200)
    assert PersistentCache.default(user).root == user / "torch_compile_speed" / "cache"


def test_linux_keeps_any_root(tmp_path, monkeypatch):
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    user = tmp_path / ("u" * 200)
    assert PersistentCache.default(user).root == user / "torch_compile_speed" / "cache"


def test_nothing_short_enough_turns_the_disk_cache_off_once(
        fake_windows, fake_winreg, tmp_path, monkeypatch, pack_log):
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / ("l" * 80)))
    user = tmp_path / ("u" * 40)
    assert PersistentCache.default(user) is None
    assert PersistentCache.default(user) is None
    warnings = pack_log.warnings()
    assert len(warnings) == 1, warnings
    assert "persistent cache off" in warnings[0] and "Compiling still works" in warnings[0]
    assert "LongPathsEnabled" in warnings[0]


def test_no_localappdata_turns_the_disk_cache_off(fake_windows, fake_winreg, tmp_path, monkeypatch,
                                                  pack_log):
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    monkeypatch.delenv("LOCALAPPDATA", raising=False)
    assert PersistentCache.default(tmp_path / ("u" * 40)) is None
    assert len(pack_log.warnings()) == 1


def test_the_operator_root_never_moves(fake_windows, fake_winreg, tmp_path, short_dir, monkeypatch,
                                       pack_log):
    monkeypatch.setenv("LOCALAPPDATA", str(short_dir))
    deep = tmp_path / ("o" * 80)
    monkeypatch.setenv(persist.ROOT_ENV, str(deep))
    assert PersistentCache.default(tmp_path) is None
    assert persist.ROOT_ENV in pack_log.warnings()[0]
    monkeypatch.setenv(persist.ROOT_ENV, str(short_dir / "ops"))
    assert PersistentCache.default(tmp_path).root == short_dir / "ops"


# --------------------------------------------------------------------------- long paths: fleet, ptx

def _deep_entry(root: Path) -> Path:
    (root / "t" / ("k" * 52)).mkdir(parents=True)
    (root / "t" / ("k" * 52) / f"{'n' * 120}.json").write_text("{}")
    (root / "fx").mkdir()
    (root / "fx" / "entry").write_text("graph")
    return root


def test_a_fleet_entry_too_deep_for_this_worker_is_refused_whole(
        fake_windows, fake_winreg, tmp_path, short_dir):
    payload = fleet_entries.pack_dir(_deep_entry(tmp_path / "src"))
    dest = short_dir / ("d" * 60)
    with pytest.raises(fleet_entries.FleetError, match="260-character limit"):
        fleet_entries.unpack_into(payload, dest)
    assert not dest.exists()  # checked before anything is written
    fake_winreg.value = 1
    assert fleet_entries.unpack_into(payload, dest) == 2


def test_a_fleet_entry_that_fits_unpacks_on_windows(fake_windows, fake_winreg, tmp_path, short_dir):
    assert fleet_entries.unpack_into(fleet_entries.pack_dir(_deep_entry(tmp_path / "src")), short_dir / "d") == 2


def test_a_too_deep_ptx_cache_dir_is_not_used(fake_windows, fake_winreg, tmp_path, short_dir,
                                             pack_log):
    deep = tmp_path / ("p" * 60)
    assert warmup.ptx_env(True, True, deep) == {}
    assert "ptx_cache_dir" in pack_log.warnings()[0] and "260" in pack_log.warnings()[0]
    assert not deep.exists()
    assert warmup.ptx_env(True, True, short_dir / "ptx") == {"TRITON_CACHE_DIR": str(short_dir / "ptx")}


def test_an_unmakeable_ptx_cache_dir_is_not_used(tmp_path, fresh_warnings, pack_log):
    (tmp_path / "file").write_text("in the way")
    assert warmup.ptx_env(True, True, tmp_path / "file" / "ptx") == {}
    assert "not used" in pack_log.warnings()[0]


# --------------------------------------------------------------------------- diagnostics

def test_diagnostics_say_kernels_compile_one_at_a_time_on_windows(fake_windows, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    text = diagnostics.Report(regions="blocks", backend="inductor", compile_threads=1).render()
    line = next(x for x in text.splitlines() if x.startswith("Kernel compiles"))
    assert "one at a time" in line and "Windows" in line and "persistent and fleet" in line
    assert "Kernel compiles" not in diagnostics.Report(backend="inductor", compile_threads=16).render()
    assert "Kernel compiles" not in diagnostics.Report(backend="cudagraphs", compile_threads=1).render()
