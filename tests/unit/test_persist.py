"""compile_core.cache.persist: the on-disk cache stays bounded, and damaged files never break a run.

Eviction is least-recently-used by entry mtime and never removes the entry in use. A damaged
entry (garbage ``meta.json``, a ``.so`` that is not a whole shared object) is discarded the
first time a process uses it, so the compile starts cold instead of tripping over it (see
``test_reliability_fallback.py`` for the real server).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from compile_core.cache import persist
from compile_core.cache.persist import META, PersistentCache, shared_object_problem

MB = 1024 * 1024
OLD = time.time() - 3600  # "left there by an earlier run"


def _entry(root: Path, name: str, size: int, mtime: float) -> Path:
    d = root / name
    (d / "inductor").mkdir(parents=True, exist_ok=True)
    (d / "inductor" / "blob.bin").write_bytes(b"\0" * size)
    os.utime(d, (mtime, mtime))
    return d


def _real_shared_object() -> Path:
    lib = Path(torch.__file__).parent / "lib"
    for name in ("libc10.so", "libtorch_global_deps.so", "libshm.so"):
        if (lib / name).is_file():
            return lib / name
    pytest.skip("no torch shared library found to copy")


def _backdate(path: Path, when: float = OLD):
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (when, when))


# --------------------------------------------------------------------------- eviction

def test_evict_drops_least_recently_used_until_it_fits(tmp_path, pack_log):
    cache = PersistentCache(tmp_path, max_bytes=int(2.5 * MB))
    for i, name in enumerate(["a", "b", "c", "d", "e"]):
        _entry(tmp_path, name, MB, mtime=1000 + i)  # a is oldest
    removed = cache.evict(keep="e")
    assert removed == ["a", "b", "c"]
    assert sorted(p.name for p in cache.entries()) == ["d", "e"]
    assert sum(persist.dir_size(p) for p in cache.entries()) <= cache.max_bytes
    assert any("evicted 3 old entries" in m for m in pack_log.infos())


def test_evict_never_removes_keep_even_when_oldest(tmp_path):
    cache = PersistentCache(tmp_path, max_bytes=int(2.5 * MB))
    _entry(tmp_path, "keep", MB, mtime=1)  # oldest of all
    _entry(tmp_path, "x", MB, mtime=2)
    _entry(tmp_path, "y", MB, mtime=3)
    assert cache.evict(keep="keep") == ["x"]
    assert sorted(p.name for p in cache.entries()) == ["keep", "y"]


def test_evict_keeps_an_oversized_keep_and_drops_everything_else(tmp_path):
    cache = PersistentCache(tmp_path, max_bytes=MB // 2)
    _entry(tmp_path, "big", 2 * MB, mtime=5)
    _entry(tmp_path, "old", MB // 4, mtime=1)
    _entry(tmp_path, "new", MB // 4, mtime=9)
    assert cache.evict(keep="big") == ["old", "new"]
    assert [p.name for p in cache.entries()] == ["big"]


def test_evict_does_nothing_under_the_bound(tmp_path, pack_log):
    cache = PersistentCache(tmp_path, max_bytes=10 * MB)
    for name in "abc":
        _entry(tmp_path, name, MB, mtime=1)
    assert cache.evict() == []
    assert len(cache.entries()) == 3
    assert not any("evicted" in m for m in pack_log.infos())


def test_touch_protects_an_entry_from_eviction(tmp_path):
    cache = PersistentCache(tmp_path, max_bytes=int(1.5 * MB))
    _entry(tmp_path, "used", MB, mtime=1)
    _entry(tmp_path, "idle", MB, mtime=2)
    cache.touch("used")  # used just now: most recent
    assert cache.evict() == ["idle"]


def test_evict_ignores_hidden_dirs_and_files_and_a_missing_root(tmp_path):
    assert PersistentCache(tmp_path / "nope", max_bytes=0).evict() == []
    cache = PersistentCache(tmp_path, max_bytes=0)
    (tmp_path / ".staging").mkdir()
    (tmp_path / ".staging" / "x").write_bytes(b"\0" * MB)
    (tmp_path / "stray.txt").write_text("not an entry")
    _entry(tmp_path, "a", 10, mtime=1)
    assert cache.evict() == ["a"]
    assert (tmp_path / ".staging" / "x").exists() and (tmp_path / "stray.txt").exists()


def test_max_bytes_from_the_operator_env(tmp_path, monkeypatch):
    monkeypatch.setenv(persist.MAX_GB_ENV, "0.5")
    assert PersistentCache(tmp_path).max_bytes == 512 * MB
    monkeypatch.delenv(persist.MAX_GB_ENV)
    assert PersistentCache(tmp_path).max_bytes == int(persist.DEFAULT_MAX_GB * 1024 ** 3)


@pytest.mark.parametrize("value", ["off", "0", "none", "FALSE"])
def test_operator_can_turn_the_cache_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(persist.ROOT_ENV, value)
    assert PersistentCache.default(tmp_path) is None


def test_default_root_is_under_the_user_dir_unless_configured(tmp_path, monkeypatch):
    monkeypatch.delenv(persist.ROOT_ENV, raising=False)
    assert PersistentCache.default(tmp_path).root == tmp_path / "torch_compile_speed" / "cache"
    monkeypatch.setenv(persist.ROOT_ENV, str(tmp_path / "shared"))
    assert PersistentCache.default(tmp_path).root == tmp_path / "shared"


def test_entry_folders_are_short_and_keep_whole_fingerprints_apart(tmp_path):
    """16 hex digits name the folder; meta.json keeps the whole fingerprint, so an entry that
    shares a folder with another fingerprint is not complete for it (a cache miss)."""
    cache = PersistentCache(tmp_path, max_bytes=MB)
    fp, other = "0123456789abcdef" + "0" * 8, "0123456789abcdef" + "1" * 8
    assert cache.entry_dir(fp) == tmp_path / "0123456789abcdef" == cache.entry_dir(other)
    cache.entry_dir(fp).mkdir(parents=True)
    cache.mark_complete(fp, {})
    assert cache.is_complete(fp) and not cache.is_complete(other)
    assert cache.inductor_dir(fp) == cache.entry_dir(fp) / "inductor"


def test_an_entry_from_the_old_layout_is_a_miss_and_evicted_like_any_other(tmp_path):
    """Before 16-hex folders, entries were named by 24 hex digits: such a folder is never read
    (a cold compile, no crash) and is evicted first once the cache is over its bound."""
    fp = "0123456789abcdef01234567"
    old = _entry(tmp_path, fp, MB, mtime=1)
    (old / META).write_text('{"fingerprint": "%s"}' % fp)
    cache = PersistentCache(tmp_path, max_bytes=int(1.5 * MB))
    assert not cache.is_complete(fp) and cache.damage(fp) == ""
    assert cache.env(fp)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / fp[:16] / "inductor")
    _entry(tmp_path, fp[:16], MB, mtime=2)
    assert cache.evict(keep=fp) == [fp]


# --------------------------------------------------------------------------- completeness

def test_mark_complete_then_is_complete(tmp_path):
    cache = PersistentCache(tmp_path, max_bytes=MB)
    cache.entry_dir("fp").mkdir(parents=True)
    assert cache.is_complete("fp") is False
    cache.mark_complete("fp", {"regions": "Block x2"})
    assert cache.is_complete("fp") is True
    meta = cache.read_meta("fp")
    assert meta["fingerprint"] == "fp" and meta["regions"] == "Block x2"
    assert meta["torch"] == torch.__version__
    # written whole through a temp file, which is gone afterwards
    assert sorted(p.name for p in cache.entry_dir("fp").iterdir()) == [META]


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b"", b"[1, 2]", b'{"fingerprint": "other"}'])
def test_unreadable_or_foreign_meta_is_not_complete(tmp_path, content):
    cache = PersistentCache(tmp_path, max_bytes=MB)
    cache.entry_dir("fp").mkdir(parents=True)
    (cache.entry_dir("fp") / META).write_bytes(content)
    assert cache.is_complete("fp") is False
    assert cache.read_meta("fp") is None


# --------------------------------------------------------------------------- damaged entries

def test_shared_object_check(tmp_path):
    real = _real_shared_object()
    assert shared_object_problem(real) == ""
    data = real.read_bytes()
    # the end of the section header table: the file's end for linker output (torch's CPU wheel,
    # inductor's own .so); torch's CUDA wheels carry data after it (patched libraries)
    shoff, shentsize, shnum = (int.from_bytes(data[a:b], "little")
                               for a, b in ((0x28, 0x30), (0x3A, 0x3C), (0x3C, 0x3E)))
    end = shoff + shentsize * shnum
    assert data[4] == 2 and data[5] == 1 and 64 < end <= len(data)  # 64-bit little-endian
    cases = {"cut.so": data[: len(data) // 2], "one_short.so": data[:end - 1], "header.so": data[:40],
             "garbage.so": os.urandom(300), "empty.so": b""}
    expected = {"cut.so": "truncated", "one_short.so": "truncated", "header.so": "truncated",
                "garbage.so": "not a shared object", "empty.so": "not a shared object"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        assert shared_object_problem(tmp_path / name) == expected[name], name
    assert shared_object_problem(tmp_path / "missing.so").startswith("unreadable")


def _good_entry(cache: PersistentCache, fp: str) -> Path:
    d = cache.inductor_dir(fp) / "ab"
    d.mkdir(parents=True)
    shutil.copyfile(_real_shared_object(), d / "cabc.so")
    (d / "cabc.cpp").write_text("// kernel source")
    (cache.inductor_dir(fp) / "fxgraph").mkdir()
    (cache.inductor_dir(fp) / "fxgraph" / "entry").write_bytes(os.urandom(64))  # torch copes
    cache.mark_complete(fp, {})
    _backdate(cache.entry_dir(fp))
    return d


def test_a_whole_entry_is_not_damaged(tmp_path):
    cache = PersistentCache(tmp_path, max_bytes=100 * MB)
    _good_entry(cache, "fp")
    assert cache.damage("fp") == ""
    assert cache.discard_if_damaged("fp") is False
    assert cache.is_complete("fp")


@pytest.mark.parametrize("how", ["garbage_so", "truncated_so", "garbage_meta"])
def test_damaged_entry_is_discarded_once_with_one_warning(tmp_path, pack_log, how):
    cache = PersistentCache(tmp_path, max_bytes=100 * MB)
    kernels = _good_entry(cache, "fp")
    if how == "garbage_so":
        (kernels / "cabc.so").write_bytes(os.urandom(300))
    elif how == "truncated_so":
        data = (kernels / "cabc.so").read_bytes()
        (kernels / "cabc.so").write_bytes(data[: len(data) // 3])
    else:
        (cache.entry_dir("fp") / META).write_bytes(os.urandom(200))
    _backdate(cache.entry_dir("fp"))
    assert cache.damage("fp")
    env = cache.env("fp")  # what a run asks for first
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(cache.inductor_dir("fp")),
                   "TRITON_CACHE_DIR": str(cache.inductor_dir("fp") / persist.TRITON_SUBDIR)}
    assert cache.inductor_dir("fp").is_dir() and not any(cache.inductor_dir("fp").iterdir())
    assert not cache.is_complete("fp")
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "damaged" in warnings[0] and "discarded" in warnings[0], warnings
    # once per process: the rebuilt entry is trusted, nothing is checked or removed again
    (cache.inductor_dir("fp") / "new.so").write_bytes(b"being written")
    _backdate(cache.entry_dir("fp"))
    cache.env("fp")
    assert (cache.inductor_dir("fp") / "new.so").exists()
    assert len(pack_log.warnings()) == 1


def test_a_shared_object_being_written_now_is_not_judged(tmp_path):
    """gcc writes the .so in place: another process sharing the cache dir may be mid-write."""
    cache = PersistentCache(tmp_path, max_bytes=100 * MB)
    kernels = _good_entry(cache, "fp")
    (kernels / "cnew.so").write_bytes(b"\x7fELF half written")  # mtime: now
    assert cache.damage("fp") == ""
    _backdate(kernels / "cnew.so")
    assert "cnew.so is truncated" in cache.damage("fp")


def test_missing_entry_is_created_not_reported(tmp_path, pack_log):
    cache = PersistentCache(tmp_path, max_bytes=MB)
    assert cache.env("new") == {"TORCHINDUCTOR_CACHE_DIR": str(cache.inductor_dir("new")),
                                "TRITON_CACHE_DIR": str(cache.inductor_dir("new") / persist.TRITON_SUBDIR)}
    assert cache.inductor_dir("new").is_dir()
    assert pack_log.warnings() == []


# --------------------------------------------------------------------------- bad settings, failing disks
# A broken setting or a disk problem costs the cache, never the run: one warning, nothing lost.

@pytest.fixture
def fresh_warnings(monkeypatch):
    """warn_once keys are per process: give this test its own set."""
    from compile_core.report import log
    monkeypatch.setattr(log, "_said", set())


@pytest.mark.parametrize("value", ["lots", "20GB", "nan", "inf", "-1", "1e400"])
def test_a_bad_max_gb_falls_back_to_the_default_with_one_warning(tmp_path, monkeypatch, pack_log,
                                                                 fresh_warnings, value):
    monkeypatch.setenv(persist.MAX_GB_ENV, value)
    assert PersistentCache(tmp_path).max_bytes == int(persist.DEFAULT_MAX_GB * 1024 ** 3)
    assert PersistentCache.default(tmp_path).max_bytes == int(persist.DEFAULT_MAX_GB * 1024 ** 3)
    warnings = pack_log.warnings()
    assert len(warnings) == 1, warnings
    assert persist.MAX_GB_ENV in warnings[0] and repr(value) in warnings[0]


def test_a_blank_max_gb_is_the_default_without_a_warning(tmp_path, monkeypatch, pack_log):
    monkeypatch.setenv(persist.MAX_GB_ENV, " ")
    assert PersistentCache(tmp_path).max_bytes == int(persist.DEFAULT_MAX_GB * 1024 ** 3)
    assert pack_log.warnings() == []


def _fail(exc: OSError):
    def raiser(*_a, **_k):
        raise exc
    return raiser


@pytest.mark.parametrize("exc", [PermissionError(13, "sharing violation"),  # Windows, file in use
                                 OSError(28, "No space left on device")])
def test_mark_complete_on_a_failing_disk_warns_once_and_keeps_the_old_meta(tmp_path, monkeypatch,
                                                                            pack_log, exc):
    cache = PersistentCache(tmp_path, max_bytes=MB)
    cache.entry_dir("fp").mkdir(parents=True)
    cache.mark_complete("fp", {"regions": "old"})
    monkeypatch.setattr(persist.os, "replace", _fail(exc))
    cache.mark_complete("fp", {"regions": "new"})  # does not raise
    cache.mark_complete("fp", {"regions": "newer"})
    assert cache.read_meta("fp")["regions"] == "old"
    assert [p.name for p in cache.entry_dir("fp").iterdir()] == [META]  # no temp file left
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and str(tmp_path) in warnings[0] and exc.strerror in warnings[0], warnings


def test_an_unwritable_cache_folder_is_not_used(tmp_path, monkeypatch, pack_log):
    cache = PersistentCache(tmp_path / "read-only user dir" / "cache", max_bytes=MB)
    monkeypatch.setattr(Path, "mkdir", _fail(PermissionError(13, "Permission denied")))
    assert cache.env("fp") == {}  # torch's own default cache dir: the run goes on
    assert cache.env("fp") == {}
    cache.mark_complete("fp", {})
    cache.touch("fp")
    assert cache.evict() == []
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "Permission denied" in warnings[0], warnings


def test_eviction_racing_another_process_skips_what_it_removed(tmp_path, monkeypatch, pack_log):
    cache = PersistentCache(tmp_path, max_bytes=int(1.5 * MB))
    for i, name in enumerate(["gone", "a", "b"]):
        _entry(tmp_path, name, MB, mtime=1000 + i)
    listed = cache.entries()
    shutil.rmtree(tmp_path / "gone")  # another ComfyUI evicted it after we listed the entries
    monkeypatch.setattr(cache, "entries", lambda: listed)
    assert cache.evict(keep="b") == ["a"]
    monkeypatch.setattr(persist.os, "utime", _fail(FileNotFoundError(2, "No such file")))
    cache.touch("a")  # evicted between our exists() and utime(): nothing to protect
    assert pack_log.warnings() == []


def test_an_unreadable_cache_root_skips_eviction_with_one_warning(tmp_path, monkeypatch, pack_log):
    cache = PersistentCache(tmp_path, max_bytes=0)
    _entry(tmp_path, "a", 10, mtime=1)
    monkeypatch.setattr(Path, "iterdir", _fail(PermissionError(13, "Permission denied")))
    assert cache.evict() == [] and cache.evict() == []
    assert len(pack_log.warnings()) == 1
