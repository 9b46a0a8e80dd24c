"""compile_core.cache.fleet: archives, integrity, compatibility and the two store kinds."""
import io
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer, free_port  # noqa: E402

from compile_core.cache import fleet, fleet_entries, fleet_stores  # noqa: E402

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
    n = fleet_entries.unpack_into(fleet_entries.pack_dir(src), tmp_path / "dst")
    assert n == 2
    assert (tmp_path / "dst" / "fx" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (tmp_path / "dst" / "kernel.so").read_bytes().startswith(b"\x7fELF")


@pytest.mark.parametrize("name", ["../escape.txt", "/tmp/tcs_abs_escape.txt", "a/../../escape.txt"])
def test_unpack_rejects_escaping_members(tmp_path, name):
    data = tar_with(tarfile.TarInfo(name))
    with pytest.raises(fleet_entries.FleetError, match="unsafe"):
        fleet_entries.unpack_into(data, tmp_path / "dst")
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/tcs_abs_escape.txt").exists()
    assert not (tmp_path / "dst").exists()  # nothing extracted at all


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_unpack_rejects_links(tmp_path, kind):
    info = tarfile.TarInfo("link")
    info.type, info.linkname = kind, "/etc/passwd"
    with pytest.raises(fleet_entries.FleetError, match="link or special"):
        fleet_entries.unpack_into(tar_with(info), tmp_path / "dst")


def test_seal_detects_corruption_truncation_and_incompatibility():
    ident = fleet_entries.artifact_identity(CPU)
    blob = fleet_entries.seal("k1", ident, b"payload" * 10)
    assert fleet_entries.unseal(blob, "k1", ident) == b"payload" * 10
    with pytest.raises(fleet_entries.FleetError, match="SHA-256"):
        fleet_entries.unseal(blob[:-1] + b"X", "k1", ident)
    with pytest.raises(fleet_entries.FleetError, match="SHA-256"):
        fleet_entries.unseal(blob[:-5], "k1", ident)
    with pytest.raises(fleet_entries.FleetError, match="incompatible"):
        fleet_entries.unseal(blob, "k1", {**ident, "torch": "0.0.1"})
    with pytest.raises(fleet_entries.FleetError, match="incompatible"):
        fleet_entries.unseal(blob, "other-key", ident)
    with pytest.raises(fleet_entries.FleetError, match="not a TorchCompileSpeed"):
        fleet_entries.unseal(b"garbage", "k1", ident)


def test_artifact_key_depends_on_fingerprint_and_identity(monkeypatch):
    a = fleet_entries.artifact_key("fp1", CPU)
    assert a == fleet_entries.artifact_key("fp1", CPU) and a != fleet_entries.artifact_key("fp2", CPU)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert fleet_entries.artifact_key("fp1", CPU) != a


def test_triton_version_is_found_under_each_distribution_name(monkeypatch):
    import importlib.metadata as md
    installed = {}

    def version(dist):
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]
    monkeypatch.setattr(md, "version", version)
    assert fleet_entries._triton_version() == "none"
    installed["pytorch-triton"] = "3.5.0+git1234"  # a nightly torch's Triton
    assert fleet_entries._triton_version() == "pytorch-triton==3.5.0+git1234"
    installed["triton"] = "3.5.0"
    assert fleet_entries._triton_version() == "triton==3.5.0"


def test_dir_store_publish_then_fetch(tmp_path):
    f = fleet.Fleet(fleet_stores.DirStore(tmp_path / "shared"))
    src = make_cache_dir(tmp_path / "w1")
    assert f.publish_from("fpX", CPU, src)
    assert f.fetch_into("fpX", CPU, tmp_path / "w2")
    assert (tmp_path / "w2" / "kernel.so").exists()
    assert not f.fetch_into("fpY", CPU, tmp_path / "w3")  # a miss, not an error
    # a corrupt shared file is refused and nothing is unpacked
    entry = next((tmp_path / "shared").glob("*.tcs"))
    entry.write_bytes(entry.read_bytes()[:-10])
    assert not f.fetch_into("fpX", CPU, tmp_path / "w4") and not (tmp_path / "w4").exists()


def test_size_limit(tmp_path):
    f = fleet.Fleet(fleet_stores.DirStore(tmp_path / "shared"), max_bytes=10)
    assert not f.publish_from("fpX", CPU, make_cache_dir(tmp_path / "w1"))
    assert not list(tmp_path.glob("shared/*.tcs"))


def test_redis_store_roundtrip_and_expiry(tmp_path):
    server = RedisServer(tmp_path)
    try:
        store = fleet_stores.RedisStore(server.url, timeout_s=2, ttl_s=3600)
        f = fleet.Fleet(store)
        assert f.publish_from("fpR", CPU, make_cache_dir(tmp_path / "w1"))
        keys = server.client.keys("tcs:compile:*")
        assert len(keys) == 1 and 0 < server.client.ttl(keys[0]) <= 3600
        assert f.fetch_into("fpR", CPU, tmp_path / "w2")
        # an escaping archive sealed with a valid hash is still refused
        key = fleet_entries.artifact_key("fpR", CPU)
        evil = fleet_entries.seal(key, fleet_entries.artifact_identity(CPU), tar_with(tarfile.TarInfo("../../evil")))
        server.client.set(keys[0], evil)
        assert not f.fetch_into("fpR", CPU, tmp_path / "w3" / "inner")
        assert not (tmp_path / "evil").exists()
    finally:
        server.stop()


def test_redis_down_costs_a_bounded_timeout():
    store = fleet_stores.RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1, ttl_s=60)
    start = time.perf_counter()
    assert not fleet.Fleet(store).fetch_into("fpD", CPU, Path("/nonexistent/never"))
    assert time.perf_counter() - start < 5


def test_no_store_configured(monkeypatch):
    monkeypatch.delenv(fleet_stores.STORE_ENV, raising=False)
    assert fleet.Fleet.from_env() is None


# --------------------------------------------------------------------------- authenticity

import logging  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

from compile_core.report import log as tcs_log  # noqa: E402

KEY_ENV = "TORCH_COMPILE_SPEED_SHARED_KEY"


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Each test sees its own warn-once keys; returns a function giving the pack's warnings.
    The once-per-process notice that a store without a key is trusted unsigned counts as said
    (``unsigned_notice`` tests it)."""
    monkeypatch.setattr(tcs_log, "_said", {"fleet-unsigned"})
    caplog.set_level(logging.INFO, logger="TorchCompileSpeed")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name == "TorchCompileSpeed" and r.levelno >= logging.WARNING]


@pytest.fixture
def no_fleet_env(monkeypatch):
    for name in (fleet_stores.STORE_ENV, fleet.MAX_MB_ENV, fleet_stores.TTL_ENV, fleet_stores.TIMEOUT_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    fleet._fleet_for.cache_clear()
    yield monkeypatch
    fleet._fleet_for.cache_clear()


def keyed(tmp_path, key, monkeypatch):
    """A worker on the shared directory with ``key`` (None: no key) in its environment."""
    if key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, key)
    return fleet.Fleet(fleet_stores.DirStore(tmp_path / "shared"))


def test_signed_entries_load_with_the_same_key(tmp_path, no_fleet_env, fresh_warnings):
    w1 = keyed(tmp_path, "s3cret", no_fleet_env)
    assert w1.publish_from("fpK", CPU, make_cache_dir(tmp_path / "w1"))
    blob = next((tmp_path / "shared").glob("*.tcs")).read_bytes()
    assert not blob.startswith(fleet_entries.MAGIC)  # signed, not a bare sealed entry
    w2 = keyed(tmp_path, "s3cret", no_fleet_env)
    assert w2.fetch_into("fpK", CPU, tmp_path / "w2")
    assert (tmp_path / "w2" / "kernel.so").exists()
    assert fresh_warnings() == []


@pytest.mark.parametrize("publisher_key", [None, "other-key"])
def test_unsigned_or_wrongly_signed_entries_are_refused(tmp_path, no_fleet_env, fresh_warnings,
                                                        publisher_key):
    assert keyed(tmp_path, publisher_key, no_fleet_env).publish_from(
        "fpK", CPU, make_cache_dir(tmp_path / "w1"))
    worker = keyed(tmp_path, "s3cret", no_fleet_env)
    for attempt in range(3):
        assert not worker.fetch_into("fpK", CPU, tmp_path / f"fetch{attempt}" / "dst")
        assert not (tmp_path / f"fetch{attempt}").exists()  # nothing unpacked
    warnings = fresh_warnings()
    assert len(warnings) == 1, warnings  # one warning, then quiet local compiles
    assert KEY_ENV in warnings[0] and "compiling locally" in warnings[0]


def test_a_forged_entry_with_a_valid_sha256_is_refused(tmp_path, no_fleet_env, fresh_warnings):
    """A hostile writer can compute the SHA-256 seal, not the HMAC."""
    worker = keyed(tmp_path, "s3cret", no_fleet_env)
    assert worker.publish_from("fpK", CPU, make_cache_dir(tmp_path / "w1"))
    entry = next((tmp_path / "shared").glob("*.tcs"))
    key = fleet_entries.artifact_key("fpK", CPU)
    evil_payload = fleet_entries.pack_dir(make_cache_dir(tmp_path / "evil"))
    sealed = fleet_entries.seal(key, fleet_entries.artifact_identity(CPU), evil_payload)
    signed = entry.read_bytes()
    mac = signed[len(fleet_entries.SIGNED_MAGIC):].split(b"\n", 1)[0]
    for forged in (sealed, fleet_entries.SIGNED_MAGIC + mac + b"\n" + sealed,  # old MAC, new content
                   fleet_entries.sign(sealed, b"guessed")):
        entry.write_bytes(forged)
        assert not worker.fetch_into("fpK", CPU, tmp_path / "dst")
        assert not (tmp_path / "dst").exists()
    assert len(fresh_warnings()) == 1


def test_without_a_key_entries_are_trusted_unsigned_and_that_is_said_once(tmp_path, no_fleet_env,
                                                                          fresh_warnings):
    tcs_log._said.discard("fleet-unsigned")  # (unsigned_notice)
    plain = keyed(tmp_path, None, no_fleet_env)
    assert plain.secret is None
    assert plain.publish_from("fpP", CPU, make_cache_dir(tmp_path / "w1"))
    entry = next((tmp_path / "shared").glob("*.tcs"))
    assert entry.read_bytes().startswith(fleet_entries.MAGIC)  # unsigned: the sealed entry as it is
    assert keyed(tmp_path, None, no_fleet_env).fetch_into("fpP", CPU, tmp_path / "w2")
    warnings = fresh_warnings()
    assert len(warnings) == 1 and "trusted unsigned" in warnings[0], warnings
    assert KEY_ENV in warnings[0] and fleet.REQUIRE_SIGNED_ENV in warnings[0]


def test_the_require_signed_switch_keeps_a_worker_without_the_key_off_the_store(tmp_path, no_fleet_env,
                                                                             fresh_warnings):
    no_fleet_env.setenv(fleet_stores.STORE_ENV, str(tmp_path / "shared"))
    no_fleet_env.setenv(fleet.REQUIRE_SIGNED_ENV, "1")
    assert fleet.Fleet.from_env() is None
    warnings = fresh_warnings()
    assert len(warnings) == 1 and "requires signed entries" in warnings[0] and KEY_ENV in warnings[0]
    no_fleet_env.setenv(KEY_ENV, "s3cret")  # with the key the store is used, signed
    assert fleet.Fleet.from_env().secret == b"s3cret"


def test_a_redis_password_never_reaches_the_log(tmp_path, no_fleet_env, fresh_warnings, caplog):
    pytest.importorskip("redis")
    tcs_log._said.discard("fleet-unsigned")  # (its notice names the store too)
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # (nothing listens there: a store that is down)
    no_fleet_env.setenv(fleet_stores.STORE_ENV, url)
    no_fleet_env.setenv(fleet_stores.TIMEOUT_ENV, "0.2")
    shared = fleet.Fleet.from_env()
    assert "hunter2" not in shared.store.describe() and "127.0.0.1" in shared.store.describe()
    assert not shared.fetch_into("fpR", CPU, tmp_path / "dst")
    lines = [r.getMessage() for r in caplog.records if r.name == "TorchCompileSpeed"]
    assert len(lines) >= 2 and any("redis://***@127.0.0.1" in ln for ln in lines), lines
    assert not any("hunter2" in ln for ln in lines), lines


def test_redact_hides_the_userinfo_of_every_url():
    text = "a redis://:p@ss@host:6379/0 b rediss://user:pw@h/1 c http://h/x@y d unix:///tmp/s"
    assert tcs_log.redact(text) == ("a redis://***@host:6379/0 b rediss://***@h/1 c http://h/x@y "
                                    "d unix:///tmp/s")


def test_from_env_fleet_uses_the_key(tmp_path, no_fleet_env):
    no_fleet_env.setenv(fleet_stores.STORE_ENV, str(tmp_path / "shared"))
    no_fleet_env.setenv(KEY_ENV, "  s3cret\n")  # as read from a file: surrounding space ignored
    f = fleet.Fleet.from_env()
    assert f is not None and f.secret == b"s3cret"
    no_fleet_env.setenv(KEY_ENV, "")
    assert fleet.Fleet.from_env().secret is None  # empty means unset


# --------------------------------------------------------------------------- bad numbers

@pytest.mark.parametrize("name,value", [(fleet.MAX_MB_ENV, "lots"), (fleet.MAX_MB_ENV, "-5"),
                                        (fleet.MAX_MB_ENV, "nan")])
def test_bad_max_mb_falls_back_with_one_warning(tmp_path, no_fleet_env, fresh_warnings, name, value):
    no_fleet_env.setenv(fleet_stores.STORE_ENV, str(tmp_path / "shared"))
    no_fleet_env.setenv(name, value)
    f = fleet.Fleet.from_env()  # must not raise at start-up
    assert f is not None and f.max_bytes == 2048 * 1024 ** 2
    fleet.Fleet(fleet_stores.DirStore(tmp_path / "shared"))  # a second fleet: no second warning
    warnings = fresh_warnings()
    assert len(warnings) == 1 and name in warnings[0] and repr(value) in warnings[0], warnings


@pytest.mark.parametrize("name,value", [(fleet_stores.TIMEOUT_ENV, "fast"), (fleet_stores.TTL_ENV, "a week"),
                                        (fleet_stores.TIMEOUT_ENV, "0"), (fleet_stores.TTL_ENV, "inf")])
def test_bad_redis_timeout_or_ttl_falls_back_with_one_warning(no_fleet_env, fresh_warnings,
                                                              name, value):
    pytest.importorskip("redis")
    no_fleet_env.setenv(fleet_stores.STORE_ENV, f"redis://127.0.0.1:{free_port()}/0")
    no_fleet_env.setenv(name, value)
    f = fleet.Fleet.from_env()  # must not raise, nor give up on the store
    assert f is not None and isinstance(f.store, fleet_stores.RedisStore)
    kwargs = f.store.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 3.0 and f.store.ttl_s == 7 * 24 * 3600
    warnings = fresh_warnings()
    assert len(warnings) == 1 and name in warnings[0] and repr(value) in warnings[0], warnings


def test_good_numbers_are_used(no_fleet_env, fresh_warnings):
    pytest.importorskip("redis")
    no_fleet_env.setenv(fleet_stores.STORE_ENV, f"redis://127.0.0.1:{free_port()}/0")
    no_fleet_env.setenv(fleet_stores.TIMEOUT_ENV, "0.5")
    no_fleet_env.setenv(fleet_stores.TTL_ENV, "60")
    no_fleet_env.setenv(fleet.MAX_MB_ENV, "1.5")
    f = fleet.Fleet.from_env()
    assert f.store.client.connection_pool.connection_kwargs["socket_timeout"] == 0.5
    assert f.store.ttl_s == 60 and f.max_bytes == int(1.5 * 1024 ** 2)
    assert fresh_warnings() == []


# --------------------------------------------------------------------------- a silent server

class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a hung Redis, a black-holed proxy)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted, self.conns, self.stop = 0, [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self.conns.append(conn)  # held open, never read from or written to

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def silent_server():
    server = SilentServer()
    yield server
    server.close()


def test_a_server_that_accepts_and_never_answers_costs_a_bounded_timeout(
        tmp_path, silent_server, no_fleet_env, fresh_warnings):
    pytest.importorskip("redis")
    timeout = 1.0
    no_fleet_env.setenv(fleet_stores.STORE_ENV, f"redis://127.0.0.1:{silent_server.port}/0")
    no_fleet_env.setenv(fleet_stores.TIMEOUT_ENV, str(timeout))
    f = fleet.Fleet.from_env()
    assert f is not None and isinstance(f.store, fleet_stores.RedisStore)
    calls = [lambda: f.fetch_into("fpS", CPU, tmp_path / "dst"),
             lambda: f.fetch_into("fpS2", CPU, tmp_path / "dst2"),
             lambda: f.publish_from("fpS", CPU, make_cache_dir(tmp_path / "w1"))]
    for call in calls:
        start = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - start
        assert not result  # a miss: the caller compiles locally
        assert elapsed < timeout + 2.0, elapsed  # one bounded attempt each, no retries, no hang
    assert silent_server.accepted >= 1  # the connection was really accepted, not refused
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst2").exists()
    warnings = fresh_warnings()
    fetch = [w for w in warnings if "not used" in w]
    assert len(fetch) == 1 and "compiling locally" in fetch[0], warnings  # one warning for fetches
