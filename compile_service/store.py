"""The on-disk kernel cache: entries published whole or not at all.

Layout under the cache root:

    entries/<key[:2]>/<key>/   one entry: the shared object, entry.json, sources,
                               and manifest.json (size + sha256 of every file)
    staging/<pid>.<key>.<rand>/ private directories entries are built in

An entry is built in a staging directory, its files and manifest are fsynced,
and one rename makes it visible: a reader never sees a half-written entry.
Publishing takes no process-wide lock (single-flight already gives each key
one writer; a lost race just discards the loser's copy). A corrupt or
incomplete entry is a miss with a warning, never a crash. Nothing here knows
about TileLang.

Hits are served from an in-memory index of verified entries, revalidated by
the files' stat signatures (a few lstat calls, no reads). Recency for the LRU
budget is kept in memory and in each entry directory's mtime (touched at most
once a minute on a hit), so a restarted daemon keeps the order. Eviction
renames an entry away before deleting it, and never takes one handed out
within `min_age` seconds. `verify` checks every entry without the index.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ENTRY_META = "entry.json"
MANIFEST_SCHEMA = 1
TOUCH_EVERY = 60.0  # seconds between mtime touches of a hit entry (the on-disk LRU clock)
ABI_FIELDS = {"loader": str, "symbol": str, "device": str, "params": list, "outputs": list, "dynamic": list}


class StoreError(OSError):
    """The cache could not be written (disk full, permissions): not a compile failure."""


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    library: str
    library_sha256: str
    library_size: int
    meta: dict  # entry.json: spec, abi, compile_seconds, toolchain, created

    @property
    def abi(self) -> dict:
        return self.meta["abi"]

    # Serialized once per entry (entries are cached and immutable), not once per hit.
    @functools.cached_property
    def abi_json(self) -> str:
        return json.dumps(self.meta["abi"], sort_keys=True)

    @functools.cached_property
    def spec_json(self) -> str:
        return json.dumps(self.meta["spec"], sort_keys=True, separators=(",", ":"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems refuse directory fsync; data fsync must work
            raise
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """Temp file in the same directory, fsync, os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass
class Damage:
    """One problem `verify` found: a bad entry, a leftover staging dir or a stray file."""

    what: str  # "entry", "staging" or "stray"
    path: Path
    why: str
    repaired: bool = False


@dataclass
class VerifyReport:
    entries_ok: int = 0
    damage: list[Damage] = field(default_factory=list)
    staging_in_use: int = 0  # staging dirs whose writer is alive: left alone

    @property
    def unrepaired(self) -> list[Damage]:
        return [d for d in self.damage if not d.repaired]


class Store:
    def __init__(self, root: Path | str, mode: int = 0o700, create: bool = True):
        """`mode`: permission bits of the cache's directories, 0o700 (owner only) or 0o750
        (group may read); files get the same minus execute. `create=False` opens an
        existing cache read-only (verify), creating and chmodding nothing."""
        if mode & 0o027 or not mode & 0o700 == 0o700:
            raise ValueError(f"cache mode {mode:#o} is not allowed: owner rwx, group at most r-x, others nothing")
        self.root = Path(root)
        self.mode = mode
        self.file_mode = mode & 0o640
        self.entries_dir = self.root / "entries"
        self.staging_dir = self.root / "staging"
        if create:
            for d in (self.root, self.entries_dir, self.staging_dir):
                d.mkdir(mode=mode, parents=True, exist_ok=True)
                os.chmod(d, mode)  # mkdir's mode is filtered by the umask, and the dir may predate us
        elif not self.entries_dir.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"{self.root} is not a kernel cache (no entries/ directory)")
        # key -> (entry, file names, stat signature) when last fully verified: hits that
        # find the same signature read nothing, and re-hash only files that changed.
        self._index: dict[str, tuple[Entry, tuple, tuple]] = {}
        self._used: dict[str, float] = {}  # key -> when last handed out (time.time())
        self._touched: dict[str, float] = {}  # key -> when its dir mtime was last set
        self._sizes: dict[str, int] = {}  # key -> bytes on disk (entries never change)
        self._lock = threading.Lock()  # guards the dicts above
        self._evict_lock = threading.Lock()  # one eviction pass at a time
        self.corrupt_found = 0
        self.evicted = 0

    # ----- paths
    def entry_path(self, key: str) -> Path:
        return self.entries_dir / key[:2] / key

    # ----- reading
    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        """The verified entry for `key`, or None (missing, incomplete or corrupt: then removed).

        `spec`, when given, must equal the spec the entry records: an entry for
        another kernel under this key is corrupt, never served.
        """
        path = self.entry_path(key)
        with self._lock:
            cached = self._index.get(key)
        if cached is None and not path.is_dir():
            return None
        # Marked before the checks: eviction (under the same lock) then either keeps the
        # entry or has already renamed it away, which the checks below see as a miss.
        self._mark_used(key, path)
        if cached is not None:
            entry, names, signature = cached
            with contextlib.suppress(OSError):
                if _signature(path, names) == signature and (spec is None or entry.meta["spec"] == spec):
                    return entry
        if not path.is_dir():
            return None
        try:
            entry, names, signature = self._check(key, path, trusted=cached[2] if cached else None)
            if spec is not None and entry.meta["spec"] != spec:
                raise ValueError(f"entry.json records spec {entry.meta['spec']!r}, not the one its key was computed from")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not path.exists():  # evicted or replaced while we read it: a plain miss
                return None
            self._discard_corrupt(key, path, str(exc))
            return None
        with self._lock:
            self._index[key] = (entry, names, signature)
        return entry

    def _check(self, key: str, path: Path, trusted: tuple | None = None) -> tuple[Entry, tuple, tuple]:
        """Reads and checks one entry against its manifest; raises OSError/ValueError/KeyError/TypeError.

        Files whose stat signature equals `trusted` are not re-hashed.
        """
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("key") != key:
            raise ValueError("manifest schema or key mismatch")
        files: dict = manifest["files"]
        library = manifest["library"]
        if library not in files or ENTRY_META not in files:
            raise ValueError("manifest does not list the library and entry.json")
        names = tuple(sorted(files))
        for name in names:
            if not isinstance(name, str) or "/" in name or name in (".", "..", MANIFEST):
                raise ValueError(f"manifest names {name!r}, which is not a file of this entry")
        owner = os.lstat(self.root).st_uid
        for name in (MANIFEST, *names):
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{name} is not a regular file")
            if st.st_uid != owner or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ValueError(f"{name} is not owned by the cache's owner or is writable by others")
            if name != MANIFEST and st.st_size != files[name]["size"]:
                raise ValueError(f"{name} has {st.st_size} bytes, manifest says {files[name]['size']}")
        signature = _signature(path, names)
        if signature != trusted:
            for name in names:
                if sha256_file(path / name) != files[name]["sha256"]:
                    raise ValueError(f"{name} does not match its sha256 in the manifest")
        meta = json.loads((path / ENTRY_META).read_text())
        _check_meta(meta)
        entry = Entry(key, path, library, files[library]["sha256"], files[library]["size"], meta)
        return entry, names, signature

    def _mark_used(self, key: str, path: Path) -> None:
        now = time.time()
        with self._lock:
            self._used[key] = now
            if now - self._touched.get(key, 0.0) < TOUCH_EVERY:
                return
            self._touched[key] = now
        with contextlib.suppress(OSError):  # best effort: recency is a hint, not a promise
            os.utime(path, (now, now))

    def _discard_corrupt(self, key: str, path: Path, why: str) -> None:
        log.warning("cache entry %s is corrupt or incomplete (%s); removing it, it will be rebuilt", key[:16], why)
        self.corrupt_found += 1
        self._forget(key)
        self._remove_dir(path)

    def _forget(self, key: str) -> None:
        with self._lock:
            for table in (self._index, self._used, self._touched, self._sizes):
                table.pop(key, None)

    def _remove_dir(self, path: Path) -> None:
        # Rename first so the key's path is free at once and no reader sees a half-deleted entry.
        trash = self.staging_dir / f"{os.getpid()}.trash.{path.name}.{os.urandom(4).hex()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = path
        shutil.rmtree(trash, ignore_errors=True)

    # ----- writing
    def new_staging(self, key: str) -> Path:
        """A private directory to build `key`'s entry in."""
        try:
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}.{key}.", dir=self.staging_dir))  # 0700 until published
        except OSError as exc:
            raise StoreError(exc.errno, f"cannot create a staging directory in {self.staging_dir}: {exc.strerror}") from exc

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def publish(self, key: str, staging: Path, library: str, meta: dict) -> Entry:
        """Seals `staging` (entry.json, manifest, fsync) and renames it into place.

        Raises StoreError when the disk refuses; the staging directory is removed either way.
        """
        try:
            write_json_atomic(staging / ENTRY_META, meta)
            files = {}
            for item in sorted(staging.iterdir()):
                if item.name == MANIFEST or not item.is_file() or item.is_symlink():
                    continue
                os.chmod(item, self.file_mode)  # never group/world-writable: loaders refuse that
                _fsync_path(item)
                files[item.name] = {"size": item.stat().st_size, "sha256": sha256_file(item)}
            if library not in files:
                raise StoreError(errno.ENOENT, f"the compiler produced no {library}")
            write_json_atomic(staging / MANIFEST, {"schema": MANIFEST_SCHEMA, "key": key, "library": library, "files": files})
            os.chmod(staging / MANIFEST, self.file_mode)
            os.chmod(staging, self.mode)
            _fsync_path(staging, directory=True)
            final = self.entry_path(key)
            if not final.parent.is_dir():
                final.parent.mkdir(exist_ok=True)
                os.chmod(final.parent, self.mode)
            try:
                os.rename(staging, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Someone published first (or a broken leftover sits there).
                if self.lookup(key) is None:
                    os.rename(staging, final)
            _fsync_path(final.parent, directory=True)
        except StoreError:
            self.discard_staging(staging)
            raise
        except OSError as exc:
            self.discard_staging(staging)
            raise StoreError(exc.errno, f"cannot publish cache entry {key[:16]} under {self.root}: {exc.strerror or exc}") from exc
        self.discard_staging(staging)  # no-op unless we lost a race
        entry = self.lookup(key)
        if entry is None:
            raise StoreError(errno.EIO, f"cache entry {key[:16]} failed verification right after publishing")
        return entry

    def remove(self, key: str) -> None:
        self._forget(key)
        self._remove_dir(self.entry_path(key))

    # ----- the budget
    def _last_used(self, key: str, path: Path) -> float:
        with self._lock:
            used = self._used.get(key)
        return used if used is not None else path.stat().st_mtime  # set at publish, touched on hits

    def _size(self, key: str, path: Path) -> int:
        with self._lock:
            size = self._sizes.get(key)
        if size is None:
            size = sum(f.lstat().st_size for f in path.iterdir())
            with self._lock:
                self._sizes[key] = size
        return size

    def _take_unused(self, key: str, cutoff: float) -> bool:
        """Removes the entry unless it was handed out after `cutoff`. The check and the rename
        happen under the lock lookups mark use under, so a hit never gets an entry being evicted."""
        path = self.entry_path(key)
        trash = self.staging_dir / f"{os.getpid()}.trash.{key}.{os.urandom(4).hex()}"
        with self._lock:
            try:
                if self._used.get(key, path.stat().st_mtime) > cutoff:
                    return False
                os.rename(path, trash)
            except OSError:
                return False
            for table in (self._index, self._used, self._touched, self._sizes):
                table.pop(key, None)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def evict(self, max_bytes: int | None, max_entries: int | None, min_age: float, protect: str | None = None) -> int:
        """Removes least recently used entries until the cache fits the budget; returns how many.

        Entries handed out (or published) within `min_age` seconds, and `protect`, are kept
        even if the cache stays over budget. Runs alongside hits and publishes: each removal
        is a rename away first, and a concurrent pass just returns 0.
        """
        if max_bytes is None and max_entries is None:
            return 0
        if not self._evict_lock.acquire(blocking=False):
            return 0
        try:
            entries = []
            for key in self.keys():
                path = self.entry_path(key)
                with contextlib.suppress(OSError):  # vanished meanwhile
                    entries.append((self._last_used(key, path), key, self._size(key, path)))
            count, total = len(entries), sum(e[2] for e in entries)
            removed = 0
            cutoff = time.time() - min_age
            for used, key, size in sorted(entries):
                if (max_entries is None or count <= max_entries) and (max_bytes is None or total <= max_bytes):
                    break
                if key == protect or used > cutoff or not self._take_unused(key, cutoff):
                    continue  # handed out recently: a client may be about to load it
                count, total, removed = count - 1, total - size, removed + 1
            if removed:
                with self._lock:
                    self.evicted += removed
                log.info("evicted %d least recently used entries; cache now %d entries, %d bytes", removed, count, total)
            return removed
        finally:
            self._evict_lock.release()

    # ----- housekeeping
    def keys(self) -> list[str]:
        return [p.name for shard in self.entries_dir.iterdir() if shard.is_dir() for p in shard.iterdir() if p.is_dir()]

    def totals(self) -> tuple[int, int]:
        """(entries, bytes) on disk now."""
        entries = size = 0
        for shard in self.entries_dir.iterdir():
            for entry in shard.iterdir() if shard.is_dir() else ():
                with contextlib.suppress(OSError):  # evicted while we walk
                    size += sum(f.lstat().st_size for f in entry.iterdir())
                    entries += 1
        return entries, size

    def verify(self, repair: bool = False) -> VerifyReport:
        """Checks every entry against its manifest (sizes, digests, required files), without the
        in-memory index, and finds staging directories left by dead writers and stray files.

        Read-only unless `repair`; then removes exactly what is damaged, and only staging
        directories whose writer is dead. Safe while a daemon serves the same cache: an
        entry that vanishes or is replaced while being checked is not damage.
        """
        report = VerifyReport()
        for shard in sorted(self.entries_dir.iterdir()):
            paths = sorted(shard.iterdir()) if shard.is_dir() and not shard.is_symlink() else [shard]
            for path in paths:
                why, ino = self._damage(shard, path)
                if why is None:
                    report.entries_ok += ino is not None
                    continue
                damage = Damage("stray" if ino is None else "entry", path, why)
                report.damage.append(damage)
                if repair:
                    damage.repaired = self._repair(path, ino)
        for item in sorted(self.staging_dir.iterdir()):
            if _writer_alive(item.name):
                report.staging_in_use += 1
                continue
            damage = Damage("staging", item, "left by a writer that is gone")
            report.damage.append(damage)
            if repair:
                damage.repaired = self._repair(item, None)
        return report

    def _damage(self, shard: Path, path: Path) -> tuple[str | None, int | None]:
        """(what is wrong or None, the entry dir's inode or None when it is no entry dir)."""
        key = path.name
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None, None  # removed meanwhile (evicted or repaired by the daemon)
        if not stat.S_ISDIR(st.st_mode) or path.parent == self.entries_dir:
            return "not a shard directory", None
        if len(key) != 64 or not key.startswith(shard.name) or not all(c in "0123456789abcdef" for c in key):
            return "not an entry directory named by its key", None
        try:
            self._check(key, path)
        except FileNotFoundError as exc:
            return (f"incomplete: {Path(exc.filename).name} is missing" if path.exists() else None), st.st_ino
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return (f"corrupt: {exc}" if path.exists() else None), st.st_ino
        return None, st.st_ino

    def _repair(self, path: Path, ino: int | None) -> bool:
        """Removes one damaged thing; an entry dir only if it is still the one checked."""
        try:
            st = path.lstat()
        except FileNotFoundError:
            return True
        if ino is not None and st.st_ino != ino:
            return True  # replaced by a fresh publish since it was checked: that one is whole
        if stat.S_ISDIR(st.st_mode):
            if ino is not None:
                self._forget(path.name)
            self._remove_dir(path)
        else:
            path.unlink(missing_ok=True)
        return not os.path.lexists(path) or (ino is not None and path.lstat().st_ino != ino)

    def clean_staging(self) -> int:
        """Removes staging directories whose writer process is gone; returns how many."""
        removed = 0
        for item in self.staging_dir.iterdir():
            if _writer_alive(item.name):
                continue
            shutil.rmtree(item, ignore_errors=True)
            removed += 1
        return removed


def _writer_alive(name: str) -> bool:
    owner = name.split(".", 1)[0]  # every staging name starts with its writer's pid
    return owner.isdigit() and (int(owner) == os.getpid() or pid_alive(int(owner)))


def _signature(path: Path, names: tuple) -> tuple:
    """What changes when any of the entry's files is replaced, truncated or rewritten."""
    out = []
    for name in (MANIFEST, *names):
        st = os.lstat(path / name)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid))
    return tuple(out)


def _check_meta(meta) -> None:
    """entry.json must carry what servicer and loader read: a spec and a well-formed ABI."""
    if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict) or not isinstance(meta.get("abi"), dict):
        raise ValueError("entry.json lacks its spec or abi")
    for name, kind in ABI_FIELDS.items():
        if not isinstance(meta["abi"].get(name), kind):
            raise ValueError(f"entry.json's abi.{name} is missing or not a {kind.__name__}")
    fixed = meta["abi"].get("fixed", {})
    if not isinstance(fixed, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in fixed.values()):
        raise ValueError("entry.json's abi.fixed is not a mapping of dims to ints")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
