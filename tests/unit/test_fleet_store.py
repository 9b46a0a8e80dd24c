"""compile_core.fleet: archives, integrity, compatibility and the two store kinds."""
import io
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer, free_port  # noqa: E402

from compile_core import fleet  # noqa: E402

CPU = torch.device("cpu")


def make_cache_dir(root: Path) -> Path:
    (root / "fx" / "ab").mkdir(parents=True)
    (root / "fx" / "ab" / "entry").write_bytes(b"graph" * 100)
    (root / "kernel.so").write_bytes(b"\x7fELF" + b"0" * 64)
    return root


def tar_with(member: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        member.size = len(data) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return buf.getvalue()


def test_pack_unpack_roundtrip(tmp_path):
    src = make_cache_dir(tmp_path / "src")
    n = fleet.unpack_into(fleet.pack_dir(src), tmp_path / "dst")
    assert n == 2
    assert (tmp_path / "dst" / "fx" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (tmp_path / "dst" / "kernel.so").read_bytes().startswith(b"\x7fELF")


@pytest.mark.parametrize("name", ["../escape.txt", "/tmp/tcs_abs_escape.txt", "a/../../escape.txt"])
def test_unpack_rejects_escaping_members(tmp_path, name):
    data = tar_with(tarfile.TarInfo(name))
    with pytest.raises(fleet.FleetError, match="unsafe"):
        fleet.unpack_into(data, tmp_path / "dst")
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/tcs_abs_escape.txt").exists()
    assert not (tmp_path / "dst").exists()  # nothing extracted at all


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_unpack_rejects_links(tmp_path, kind):
    info = tarfile.TarInfo("link")
    info.type, info.linkname = kind, "/etc/passwd"
    with pytest.raises(fleet.FleetError, match="link or special"):
        fleet.unpack_into(tar_with(info), tmp_path / "dst")


def test_seal_detects_corruption_truncation_and_incompatibility():
    ident = fleet.artifact_identity(CPU)
    blob = fleet.seal("k1", ident, b"payload" * 10)
    assert fleet.unseal(blob, "k1", ident) == b"payload" * 10
    with pytest.raises(fleet.FleetError, match="SHA-256"):
        fleet.unseal(blob[:-1] + b"X", "k1", ident)
    with pytest.raises(fleet.FleetError, match="SHA-256"):
        fleet.unseal(blob[:-5], "k1", ident)
    with pytest.raises(fleet.FleetError, match="incompatible"):
        fleet.unseal(blob, "k1", {**ident, "torch": "0.0.1"})
    with pytest.raises(fleet.FleetError, match="incompatible"):
        fleet.unseal(blob, "other-key", ident)
    with pytest.raises(fleet.FleetError, match="not a TorchCompileSpeed"):
        fleet.unseal(b"garbage", "k1", ident)


def test_artifact_key_depends_on_fingerprint_and_identity(monkeypatch):
    a = fleet.artifact_key("fp1", CPU)
    assert a == fleet.artifact_key("fp1", CPU) and a != fleet.artifact_key("fp2", CPU)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert fleet.artifact_key("fp1", CPU) != a


def test_triton_version_is_found_under_each_distribution_name(monkeypatch):
    import importlib.metadata as md
    installed = {}

    def version(dist):
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]
    monkeypatch.setattr(md, "version", version)
    assert fleet._triton_version() == "none"
    installed["pytorch-triton"] = "3.5.0+git1234"  # a nightly torch's Triton
    assert fleet._triton_version() == "pytorch-triton==3.5.0+git1234"
    installed["triton"] = "3.5.0"
    assert fleet._triton_version() == "triton==3.5.0"


def test_dir_store_publish_then_fetch(tmp_path):
    f = fleet.Fleet(fleet.DirStore(tmp_path / "shared"))
    src = make_cache_dir(tmp_path / "w1")
    assert f.publish_from("fpX", CPU, src)
    assert f.fetch_into("fpX", CPU, tmp_path / "w2")
    assert (tmp_path / "w2" / "kernel.so").exists()
    assert not f.fetch_into("fpY", CPU, tmp_path / "w3")  # a miss, not an error
    # a corrupt shared file is refused and nothing is unpacked
    entry = next((tmp_path / "shared").glob("*.tcs"))
    entry.write_bytes(entry.read_bytes()[:-10])
    assert not f.fetch_into("fpX", CPU, tmp_path / "w4") and not (tmp_path / "w4").exists()


def test_prewarm_manifest_is_shared_sealed(tmp_path):
    f = fleet.Fleet(fleet.DirStore(tmp_path / "shared"))
    assert f.fetch_manifest() is None  # nothing published yet
    manifest = {"modules": ["torch._inductor.compile_fx"], "files": ["/x.py"], "cpu": True}
    assert f.publish_manifest(manifest)
    assert f.fetch_manifest() == manifest
    entry = next((tmp_path / "shared").glob("prewarm-*.tcs"))
    entry.write_bytes(entry.read_bytes().replace(b"compile_fx", b"compile_fy"))
    assert f.fetch_manifest() is None  # tampered: the SHA-256 no longer matches


def test_prefetch_fills_the_local_cache_once(tmp_path):
    from compile_core.persist import PersistentCache
    f = fleet.Fleet(fleet.DirStore(tmp_path / "shared"))
    fp = "ab" * 12
    assert f.publish_from(fp, CPU, make_cache_dir(tmp_path / "w1"))
    local = PersistentCache(tmp_path / "w2")
    assert f.prefetch([fp, "cd" * 12], CPU, local) == [local.inductor_dir(fp)]  # cd..: a miss
    assert (local.inductor_dir(fp) / "kernel.so").exists() and local.is_complete(fp)
    assert f.prefetch([fp], CPU, local) == []  # already complete: not fetched again


def test_size_limit(tmp_path):
    f = fleet.Fleet(fleet.DirStore(tmp_path / "shared"), max_bytes=10)
    assert not f.publish_from("fpX", CPU, make_cache_dir(tmp_path / "w1"))
    assert not list(tmp_path.glob("shared/*.tcs"))


def test_redis_store_roundtrip_and_expiry(tmp_path):
    server = RedisServer(tmp_path)
    try:
        store = fleet.RedisStore(server.url, timeout_s=2, ttl_s=3600)
        f = fleet.Fleet(store)
        assert f.publish_from("fpR", CPU, make_cache_dir(tmp_path / "w1"))
        keys = server.client.keys("tcs:compile:*")
        assert len(keys) == 1 and 0 < server.client.ttl(keys[0]) <= 3600
        assert f.fetch_into("fpR", CPU, tmp_path / "w2")
        # an escaping archive sealed with a valid hash is still refused
        key = fleet.artifact_key("fpR", CPU)
        evil = fleet.seal(key, fleet.artifact_identity(CPU), tar_with(tarfile.TarInfo("../../evil")))
        server.client.set(keys[0], evil)
        assert not f.fetch_into("fpR", CPU, tmp_path / "w3" / "inner")
        assert not (tmp_path / "evil").exists()
    finally:
        server.stop()


def test_redis_down_costs_a_bounded_timeout():
    store = fleet.RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1, ttl_s=60)
    start = time.perf_counter()
    assert not fleet.Fleet(store).fetch_into("fpD", CPU, Path("/nonexistent/never"))
    assert time.perf_counter() - start < 5


def test_no_store_configured(monkeypatch):
    monkeypatch.delenv(fleet.STORE_ENV, raising=False)
    assert fleet.Fleet.from_env() is None
