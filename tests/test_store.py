"""The store on its own (no daemon, no TileLang): verify, the LRU budget,
permissions, and the loader's refusals. Entries here hold a fake library."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from client.errors import CorruptArtifact
from client.loader import entry_directory, find_published
from compile_service.config import parse_size, tcp_address
from compile_service.metrics import Metrics
from compile_service.store import Budget, LocalStore, StoreError
from compile_service.store.check import verify
from proto.entry import EntryRefused, check_files, signature
from proto.trust import UntrustedPath, read_verified

ROOT = Path(__file__).resolve().parent.parent
ABI = {"loader": "c", "symbol": "call", "device": "cpu", "params": [{"name": "Y", "dtype": "float32", "shape": [4]}], "outputs": [0], "dynamic": []}


def Store(root, **options) -> LocalStore:
    return LocalStore(root, metrics=Metrics(), **options)


def counted(store: LocalStore, name: str) -> int:
    return store.metrics.counters()[name]


def put(store: LocalStore, i: int, size: int = 1000) -> str:
    key = f"{i:064x}"
    staging = store.new_staging(key)
    (staging / "kernel.so").write_bytes(os.urandom(size))
    store.put(key, staging, "kernel.so", {"spec": {"kind": "fake", "i": i}, "abi": ABI})
    return key


def age(store: LocalStore, key: str, seconds_ago: float) -> None:
    """Pretend the entry was last handed out `seconds_ago` (on disk; a fresh Store reads that)."""
    t = time.time() - seconds_ago
    os.utime(store.entry_path(key), (t, t))


def test_an_abi_that_fixes_sizes_must_fix_them_to_ints(tmp_path):
    store = Store(tmp_path / "cache")
    for i, fixed in enumerate(({"M": "256"}, {"M": True}, ["M"])):
        staging = store.new_staging(f"{i:064x}")
        (staging / "kernel.so").write_bytes(b"lib")
        with pytest.raises(StoreError, match="failed verification"):  # never published as servable
            store.put(f"{i:064x}", staging, "kernel.so", {"spec": {"i": i}, "abi": {**ABI, "fixed": fixed}})
        assert store.lookup(f"{i:064x}") is None
    staging = store.new_staging(f"{9:064x}")
    (staging / "kernel.so").write_bytes(b"lib")
    assert store.put(f"{9:064x}", staging, "kernel.so", {"spec": {}, "abi": {**ABI, "fixed": {"M": 256}}}).abi["fixed"] == {"M": 256}


def test_verify_reports_read_only_and_repairs_only_damage(tmp_path):
    store = Store(tmp_path / "cache")
    good, truncated, missing = (put(store, i) for i in range(3))
    lib = store.entry_path(truncated) / "kernel.so"
    lib.write_bytes(lib.read_bytes()[:10])
    (store.entry_path(missing) / "entry.json").unlink()
    (store.entries_dir / "zz").write_text("stray")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (store.staging_dir / f"{dead}.{good}.abc").mkdir()  # its writer is gone
    (store.staging_dir / f"{os.getppid()}.{good}.def").mkdir()  # its writer (pytest's parent) lives

    def cli(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "compile_service.cli", "verify", "--cache-dir", str(store.root), *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.returncode, out.stdout

    rc, out = cli()
    assert rc == 1
    assert re.search(rf"DAMAGED +entry: .*{truncated}: corrupt: kernel.so has 10 bytes", out)
    assert re.search(rf"DAMAGED +entry: .*{missing}: incomplete: entry.json is missing", out)
    assert "DAMAGED   stray" in out and f"DAMAGED staging: {store.staging_dir}/{dead}." in out
    assert "1 entries ok, 4 damaged, 4 left unrepaired, 1 staging dirs in use" in out
    assert store.entry_path(truncated).exists() and len(list(store.staging_dir.iterdir())) == 2  # read-only

    rc, out = cli("--repair")
    assert rc == 0 and out.count("removed") == 4, out
    assert sorted(store.keys()) == [good] and [p.name.split(".")[0] for p in store.staging_dir.iterdir()] == [str(os.getppid())]
    assert cli()[0] == 0
    assert store.lookup(good) is not None


def test_evicts_least_recently_used_never_recent_ones(tmp_path):
    store = Store(tmp_path / "cache")
    keys = [put(store, i) for i in range(5)]
    for n, key in enumerate(keys):
        age(store, key, 1000 - n * 100)  # keys[0] oldest
    store = Store(store.root)  # a restarted daemon: only the mtimes say what was used when
    assert store.lookup(keys[0]) is not None  # a hit makes keys[0] the most recent
    assert store.evict(Budget(None, 3, 0)) == 2
    assert sorted(store.keys()) == sorted([keys[0], keys[3], keys[4]])
    assert counted(store, "evictions") == 2 and not list(store.staging_dir.iterdir())  # renamed away, then deleted

    # Handed out within min_age: kept even over budget.
    assert store.lookup(keys[3]) and store.lookup(keys[4])
    assert store.evict(Budget(None, 1, 300)) == 0 and len(store.keys()) == 3
    # The byte budget: each entry is its library plus entry.json and manifest.
    assert store.evict(Budget(parse_size("1K"), None, 0), protect=keys[0]) == 2
    assert store.keys() == [keys[0]]
    assert store.lookup(keys[3]) is None and counted(store, "corrupt") == 0


def test_eviction_runs_alongside_hits_and_publishes(tmp_path):
    store = Store(tmp_path / "cache")
    keys = [put(store, i) for i in range(20)]
    stop, errors = threading.Event(), []

    def hits():
        while not stop.is_set():
            for key in keys:
                try:
                    entry = store.lookup(key, {"kind": "fake", "i": int(key, 16)})
                    assert entry is None or entry.meta["spec"]["i"] == int(key, 16)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)

    readers = [threading.Thread(target=hits) for _ in range(3)]
    for t in readers:
        t.start()
    for i in range(20, 60):
        put(store, i)
        store.evict(Budget(None, 10, 0))
    stop.set()
    for t in readers:
        t.join()
    assert errors == [] and counted(store, "corrupt") == 0
    # An entry hit while a pass runs is spared by it (it was just handed out); once the hits
    # stop, one more pass brings the cache to its budget.
    store.evict(Budget(None, 10, 0))
    assert len(store.keys()) == 10 and counted(store, "evictions") == 50


def test_owner_only_by_default_group_readable_when_asked(tmp_path):
    store = Store(tmp_path / "private")
    key = put(store, 1)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(store.root) == mode(store.entry_path(key)) == 0o700
    assert mode(store.entry_path(key) / "kernel.so") == 0o600

    shared = Store(tmp_path / "shared", mode=0o750)
    key = put(shared, 1)
    entry = shared.lookup(key)
    assert mode(shared.root) == mode(entry.path) == mode(entry.path.parent) == 0o750
    assert {mode(f) for f in entry.path.iterdir()} == {0o640}  # group-readable, never group-writable
    assert read_verified(entry.path / entry.library, entry.library_sha256, entry.library_size, owner=os.geteuid())
    with pytest.raises(ValueError, match="not allowed"):
        Store(tmp_path / "bad", mode=0o770)


def test_loader_refuses_symlinks_foreign_owners_and_writable_files(tmp_path):
    store = Store(tmp_path / "cache")
    entry = store.lookup(put(store, 1))
    lib = entry.path / entry.library
    args = (entry.library_sha256, entry.library_size)
    me = os.geteuid()
    assert read_verified(lib, *args, owner=me)

    os.chmod(lib, 0o620)
    with pytest.raises(EntryRefused, match="writable by group or others"):
        read_verified(lib, *args, owner=me)
    os.chmod(lib, 0o600)
    if os.geteuid() == 0:
        os.chown(lib, 12345, -1)
        with pytest.raises(EntryRefused, match="owned by uid 12345"):
            read_verified(lib, *args, owner=me)
        os.chown(lib, 0, -1)
    real = tmp_path / "elsewhere.so"
    real.write_bytes(lib.read_bytes())
    lib.unlink()
    lib.symlink_to(real)
    with pytest.raises(EntryRefused, match="symlinks are refused"):
        read_verified(lib, *args, owner=me)
    assert store.lookup(entry.key) is None and counted(store, "corrupt") == 1  # the daemon refuses it too


# Names no reader accepts for a file of an entry: one rule (proto.entry.is_file_name) for the
# store, verify, the loader, the fleet tier and bundles (the tier once let a leading "_" through).
NOT_FILE_NAMES = ["_hidden", ".hidden", "-option", "..", "../kernel.so", "a/b", "manifest.json", "x" * 65, "", "kernel.so\n"]


@pytest.mark.parametrize("name", NOT_FILE_NAMES)
def test_an_entry_naming_a_file_it_cannot_hold_is_refused_by_every_reader(tmp_path, name):
    store = Store(tmp_path / "cache")
    key = put(store, 1)
    spec = store.lookup(key).meta["spec"]
    manifest_path = store.entry_path(key) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    with pytest.raises(EntryRefused, match="not a plain file name"):
        check_files({**manifest["files"], name: manifest["files"]["kernel.so"]}, "kernel.so")
    manifest["files"][name] = manifest["files"]["kernel.so"]
    manifest_path.write_text(json.dumps(manifest))
    assert find_published(store.root, key, spec, os.geteuid()) is None  # the client's own look
    assert "not a plain file name" in verify(store).damage[0].why  # verify, without the index
    assert store.lookup(key) is None and counted(store, "corrupt") == 1  # the daemon's, then removed


def test_nothing_read_back_is_unpickled():
    """Cache files and wire messages are JSON and protobuf only."""
    for package in ("compile_service", "client", "kernels", "proto"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"\b(pickle|cPickle|dill|marshal|shelve)\b", text), f"{path} mentions an unpickler"


def test_sizes_and_tcp_addresses():
    assert parse_size("10G") == 10 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5KiB") == 1536 and parse_size("77") == 77
    with pytest.raises(ValueError, match="size"):
        parse_size("ten gigs")
    assert tcp_address("7000") == "127.0.0.1:7000" and tcp_address("localhost:7000") == "localhost:7000" and tcp_address("[::1]:7") == "[::1]:7"
    for remote in ("0.0.0.0:7000", "10.1.2.3:7000", "example.com:7000", "[::]:7000"):
        with pytest.raises(ValueError, match="allow-remote"):
            tcp_address(remote)
    assert tcp_address("0.0.0.0:7000", allow_remote=True) == "0.0.0.0:7000"
    with pytest.raises(ValueError, match="port"):
        tcp_address("127.0.0.1:99999")
    assert json.loads(json.dumps(ABI)) == ABI


def test_the_same_bytes_under_two_keys_are_stored_once(tmp_path):
    store = Store(tmp_path / "cache")
    data = os.urandom(5000)
    for i in range(2):
        staging = store.new_staging(f"{i:064x}")
        (staging / "kernel.so").write_bytes(data)
        store.put(f"{i:064x}", staging, "kernel.so", {"spec": {"i": i}, "abi": ABI})
    a, b = (store.entry_path(f"{i:064x}") / "kernel.so" for i in range(2))
    assert a.stat().st_ino == b.stat().st_ino and a.stat().st_nlink == 3  # both entries and the blob
    assert 5000 <= store.usage()[1] < 2 * 5000
    store.remove(f"{0:064x}")
    store.remove(f"{1:064x}")
    assert store.usage() == (0, 0) and not any(p.is_file() for p in store.blobs.dir.rglob("*"))  # unlinked blobs collected


def test_the_budget_counts_and_evicts_device_binaries(tmp_path):
    binaries = tmp_path / "cache" / "device-binaries" / "nvrtc-13.0"
    binaries.mkdir(parents=True)
    store = Store(tmp_path / "cache", extra_usage=(tmp_path / "cache" / "device-binaries",))
    old, fresh = binaries / "old.cubin", binaries / "fresh.cubin"
    old.write_bytes(os.urandom(20_000))
    fresh.write_bytes(os.urandom(20_000))
    (binaries / "x.lock").write_bytes(b"")  # locks are not cache content
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    key = put(store, 1, size=1000)
    age(store, key, 1800)
    store = Store(store.root, extra_usage=store.extra_usage)  # a restarted daemon: only mtimes say what was used when
    assert store.usage()[1] > 40_000
    assert store.evict(Budget(parse_size("30K"), None, 600)) == 0  # only the old binary had to go
    assert not old.exists() and fresh.exists() and store.entry_path(key).is_dir()
    assert store.evict(Budget(parse_size("10K"), None, 600)) == 1  # then the entry (fresh stays: within min_age)
    assert fresh.exists() and store.usage()[0] == 0


def test_corruption_the_stat_signature_cannot_see_is_found_by_a_recheck(tmp_path):
    """What ReportCorrupt runs: a full re-hash, whatever the index remembers."""
    store = Store(tmp_path / "cache")
    entry = store.lookup(put(store, 1))
    lib = entry.path / entry.library
    lib.write_bytes(b"x" + lib.read_bytes()[1:])
    # As if the change had kept every stat field (silent corruption on the disk): the index
    # still vouches for it, and a hit serves it.
    with store._lock:
        store._index[entry.key] = (entry, store._index[entry.key][1], signature(entry.path, store._index[entry.key][1]))
    assert store.lookup(entry.key) is entry
    assert "sha256" in store.recheck(entry.key)
    assert store.lookup(entry.key) is None and counted(store, "corrupt") == 1 and not entry.path.exists()
    assert store.recheck(entry.key) is None  # absent: nothing to do


def test_untrusted_directories_and_links_are_refused_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(UntrustedPath, match="writable by group or others"):
        Store(tmp_path / "open")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "staging").symlink_to(elsewhere)
    with pytest.raises(UntrustedPath, match="staging is a symbolic link"):
        Store(tmp_path / "linked")
    if os.geteuid() == 0:
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", 12345, -1)
        with pytest.raises(UntrustedPath, match="owned by uid 12345"):
            Store(tmp_path / "theirs")
        with pytest.raises(UntrustedPath, match="owned by uid 12345"):
            Store(tmp_path / "theirs", create=False)

    # The start-up sweep removes only staging dirs it made, never through a link.
    store = Store(tmp_path / "cache")
    (store.staging_dir / "1.link").symlink_to(elsewhere)
    (store.staging_dir / f"1.{'a' * 64}.xyz").symlink_to(elsewhere / "keep")
    (store.staging_dir / "notes").mkdir()
    (store.staging_dir / f"1.{'b' * 64}.abc").mkdir()  # pid 1 is init: alive, kept
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (store.staging_dir / f"{dead}.{'c' * 64}.abc").mkdir()
    assert store.clean_staging() == 1
    assert sorted(p.name for p in store.staging_dir.iterdir()) == sorted(["1.link", f"1.{'a' * 64}.xyz", "notes", f"1.{'b' * 64}.abc"])
    assert (elsewhere / "keep").is_dir()


def test_the_loader_loads_only_real_entry_dirs_of_the_daemon_under_its_root(tmp_path):
    store = Store(tmp_path / "cache")
    entry = store.lookup(put(store, 1))
    me = os.geteuid()
    assert entry_directory(store.root, entry.path, entry.key, me) == entry.path
    with pytest.raises(CorruptArtifact, match="is not where the daemon's cache"):
        entry_directory(tmp_path / "other", entry.path, entry.key, me)
    with pytest.raises(CorruptArtifact, match="is not where the daemon's cache"):
        entry_directory(store.root, entry.path / ".." / entry.key, entry.key, me)
    with pytest.raises(CorruptArtifact, match=f"owned by uid {me}"):
        entry_directory(store.root, entry.path, entry.key, me + 1)
    moved = tmp_path / "moved"
    entry.path.rename(moved)
    entry.path.symlink_to(moved)
    with pytest.raises(CorruptArtifact, match="is a symbolic link"):
        entry_directory(store.root, entry.path, entry.key, me)
    assert store.lookup(entry.key) is None and moved.is_dir()  # the daemon drops the link, not what it points to
