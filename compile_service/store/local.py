"""The local disk store: entries published whole or not at all.

Layout under the cache root:

    entries/<key[:2]>/<key>/    one entry: entry.json, manifest.json (size + sha256 of every
                                file), and hard links to the library and sources in blobs/
    blobs/<sha[:2]>/<sha>       file bytes, stored once (store.blobs)
    staging/<pid>.<key>.<rand>/ private directories entries are built in

An entry is built in a staging directory, its files and manifest are fsynced,
and one rename makes it visible: a reader never sees a half-written entry.
Publishing takes no process-wide lock (single-flight already gives each key
one writer; a lost race just discards the loser's copy). A corrupt or
incomplete entry is a miss with a warning, never a crash. Nothing here knows
about TileLang.

Hits are served from an in-memory index of verified entries, revalidated by
the files' stat signatures (a few lstat calls, no reads; the ctime is in them,
so content rewritten with its mtime put back is seen and re-hashed). Recency for the LRU
budget (store.budget) is kept in memory and in each entry directory's mtime
(touched at most once a minute on a hit), so a restarted daemon keeps the
order. `store.check` verifies and repairs without the index, and `store.budget` evicts,
both through the public methods here.

Claims on builds (store.base.Claims) are the `claims` attribute: LocalClaims unless
the fleet tier replaced them (store.tiered); the scheduler is handed them as a part of
its own, and the store only closes them. What the tier shares it gets from the
publish hook (`on_publish`). The entry's rules (key, file names, manifest,
entry.json, stat signature) are proto.entry's; the safe reads are proto.trust's.

Trust: the cache root and every directory in it must be real directories (not
links) owned by this process's uid and writable by no one else (proto/trust.py),
and every file of an entry must be owned by that uid: a cache another user
controls is refused, never served from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from proto.entry import ENTRY_META, HEX64, MANIFEST, Entry, EntryRefused, check_dirs, check_files, is_key, manifest_record, read_manifest, read_meta, signature
from proto.paths import entry_dir
from proto.trust import UntrustedPath, check_dir, private_dir, problem, read_owned

from ..fsutil import fsync_path, pid_alive, real_dir, remove_tree, sha256_file, write_json_atomic
from . import budget
from .base import Budget, Claims, LocalClaims, Storage, StoreError
from .blobs import Blobs

log = logging.getLogger(__name__)

TOUCH_EVERY = 60.0  # seconds between this store's mtime touches of an entry it hands out (the on-disk LRU clock)

# What this process puts in staging/: "<pid>.<key>.<random>" build dirs and "<pid>.trash.<name>.<hex>"
# dirs being deleted. Nothing else there is ever removed by the start-up sweep.
STAGING_NAME = re.compile(rf"([0-9]+)\.(?:{HEX64}\.[a-z0-9_]+|import\.[a-z0-9_]+|trash\.[A-Za-z0-9_.-]+\.[0-9a-f]{{8}})")


class LocalStore(Storage):
    def __init__(self, root: Path | str, mode: int = 0o700, create: bool = True, metrics=None, extra_usage: tuple[Path, ...] = ()):
        """`mode`: permission bits of the cache's directories, 0o700 (owner only) or 0o750
        (group may read); files get the same minus execute. `create=False` opens an
        existing cache read-only (verify), creating and chmodding nothing. `metrics` counts
        corrupt entries and evictions (compile_service.metrics). `extra_usage`: directories
        of other caches under the root (device binaries) that the budget counts and evicts.

        Raises UntrustedPath when the root, entries/, staging/ or blobs/ is a link, is not
        owned by this process's uid, or is writable by group or others: whoever controls them
        could plant entries (their code, run by every client) or links (chmods and deletes
        of their choosing).
        """
        if mode & 0o027 or not mode & 0o700 == 0o700:
            raise ValueError(f"cache mode {mode:#o} is not allowed: owner rwx, group at most r-x, others nothing")
        self.root = Path(root)
        self.mode = mode
        self.file_mode = mode & 0o640
        self.owner = os.geteuid()  # entries are trusted when this uid wrote them, never whoever owns the root
        self.entries_dir = self.root / "entries"
        self.staging_dir = self.root / "staging"
        self.blobs = Blobs(self.root, mode)
        self.extra_usage = tuple(Path(p) for p in extra_usage)
        self.metrics = metrics
        if create:
            fix = f"remove it (or choose another cache directory) and let kernel-service create it as uid {self.owner}"
            self.root.parent.mkdir(parents=True, exist_ok=True)
            for d in (self.root, self.entries_dir, self.staging_dir, self.blobs.dir):
                private_dir(d, mode, "cache directory", fix)
        else:
            fix = "run this as the cache's owner, after checking what it holds"
            if not os.path.lexists(self.root):
                raise FileNotFoundError(errno.ENOENT, f"{self.root} is not a kernel cache (no such directory)")
            check_dir(self.root, self.owner, "cache directory", fix)
            if not self.entries_dir.is_dir():
                raise FileNotFoundError(errno.ENOENT, f"{self.root} is not a kernel cache (no entries/ directory)")
            for d in (self.entries_dir, self.staging_dir):
                check_dir(d, self.owner, "cache directory", fix)
        # key -> (entry, file names, stat signature) when last fully verified: hits that
        # find the same signature read nothing, and re-hash only files that changed.
        self._index: dict[str, tuple[Entry, tuple, tuple]] = {}
        self._used: dict[str, float] = {}  # key -> when last handed out (time.time())
        self._touched: dict[str, float] = {}  # key -> when its dir mtime was last set
        self._lock = threading.Lock()  # guards the dicts above
        self.evict_lock = threading.Lock()  # one eviction pass at a time (store.budget)
        self.claims: Claims = LocalClaims()  # the fleet tier puts its own here (store.tiered)
        self.on_publish: list[Callable[[Entry], None]] = []  # called with each entry put() publishes

    # ----- paths
    def entry_path(self, key: str) -> Path:
        return entry_dir(self.root, key)

    # ----- reading
    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        """The verified entry for `key`, or None (missing, incomplete or corrupt: then removed).

        `spec`, when given, must equal the spec the entry records: an entry for
        another kernel under this key is corrupt, never served.
        """
        path = self.entry_path(key)
        with self._lock:
            cached = self._index.get(key)
        if cached is None and not os.path.lexists(path):
            return None
        # Marked before the checks: eviction (under the same lock) then either keeps the
        # entry or has already renamed it away, which the checks below see as a miss.
        self._mark_used(key, path)
        if cached is not None:
            entry, names, sig = cached
            with contextlib.suppress(OSError):
                if signature(path, names) == sig and (spec is None or entry.meta["spec"] == spec):
                    return entry
        if not os.path.lexists(path):
            return None
        try:
            entry, names, sig = self._check(key, path, trusted=cached[2] if cached else None, spec=spec)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not os.path.lexists(path):  # evicted or replaced while we read it: a plain miss
                return None
            self._discard_corrupt(key, path, str(exc))
            return None
        with self._lock:
            self._index[key] = (entry, names, sig)
        return entry

    def check_entry(self, key: str) -> Entry:
        """`key`'s entry checked in full (every file hashed), as if never seen, without the index;
        raises OSError: EntryRefused for damage, FileNotFoundError for a missing file."""
        return self._check(key, self.entry_path(key))[0]

    def _check(self, key: str, path: Path, trusted: tuple | None = None, spec: dict | None = None) -> tuple[Entry, tuple, tuple]:
        return read_entry(key, path, self.owner, trusted, spec)

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
        if self.metrics is not None:
            self.metrics.add(corrupt=1)
        self._forget(key)
        self._remove_dir(path)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._drop_records(key)

    def _drop_records(self, key: str) -> None:
        """Forgets `key` (the caller holds self._lock)."""
        for table in (self._index, self._used, self._touched):
            table.pop(key, None)

    def _trash(self, name: str) -> Path:
        return self.staging_dir / f"{os.getpid()}.trash.{name}.{os.urandom(4).hex()}"

    def _remove_dir(self, path: Path) -> None:
        # Rename first so the key's path is free at once and no reader sees a half-deleted entry.
        trash = self._trash(path.name)
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = path
        remove_tree(trash)

    def remove_path(self, path: Path) -> None:
        """Removes one thing under the cache that verify found damaged: an entry directory (then
        forgotten), a staging or stray directory (renamed away first, never followed), or a
        file or link (the link itself, never its target)."""
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            path.unlink(missing_ok=True)
            return
        if is_key(path.name) and path == self.entry_path(path.name):
            self._forget(path.name)
        self._remove_dir(path)

    def recheck(self, key: str) -> str | None:
        """Checks the entry in full, as if never seen (every file re-hashed), and removes it if
        it fails: a client found it corrupt. Returns what was wrong, or None (whole or absent)."""
        path = self.entry_path(key)
        if not os.path.lexists(path):
            return None
        try:
            entry, names, sig = self._check(key, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not os.path.lexists(path):
                return None
            self._discard_corrupt(key, path, f"reported by a client; {exc}")
            return str(exc)
        with self._lock:
            self._index[key] = (entry, names, sig)
        return None

    # ----- writing
    def new_staging(self, key: str) -> Path:
        """A private directory to build `key`'s entry in (or, for "import", to check a bundle's
        files in before their entries are built)."""
        try:
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}.{key}.", dir=self.staging_dir))  # 0700 until published
        except OSError as exc:
            raise StoreError(exc.errno, f"cannot create a staging directory in {self.staging_dir}: {exc.strerror}") from exc

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def put(self, key: str, staging: Path, library: str, meta: dict, durable: bool = True, hooks: bool = True) -> Entry:
        """Seals `staging` (entry.json, manifest, fsync, files linked to their blobs), renames
        it into place, then calls the publish hooks (`on_publish`) with the entry.

        `durable=False` skips the fsyncs, for an entry that can be had again cheaply (one read
        through from the fleet tier): a crash may then leave it torn, which the digest check
        after a restart (the index is in memory) turns into a miss, never a wrong kernel.
        `hooks=False` publishes without calling the hooks (an entry the fleet tier itself fetched).
        Raises StoreError when the disk refuses; the staging directory is removed either way.
        """
        sync = fsync_path if durable else _no_sync
        try:
            write_json_atomic(staging / ENTRY_META, meta, fsync=durable)
            files = {}
            for item in sorted(staging.iterdir()):
                if item.name == MANIFEST or not item.is_file() or item.is_symlink():
                    continue
                os.chmod(item, self.file_mode)  # never group/world-writable: loaders refuse that
                sync(item)
                files[item.name] = {"size": item.stat().st_size, "sha256": sha256_file(item)}
                if item.name != ENTRY_META:  # the entry's own record stays its own
                    self.blobs.adopt(item, files[item.name]["sha256"], durable)
            if library not in files:
                raise StoreError(errno.ENOENT, f"the compiler produced no {library}")
            try:
                check_files(files, library)  # what lookup would refuse is never published
            except EntryRefused as exc:
                raise StoreError(errno.EINVAL, f"cannot publish cache entry {key[:16]}: {exc}") from None
            write_json_atomic(staging / MANIFEST, manifest_record(key, library, files), fsync=durable)
            os.chmod(staging / MANIFEST, self.file_mode)
            os.chmod(staging, self.mode)
            sync(staging, directory=True)
            final = self.entry_path(key)
            private_dir(final.parent, self.mode, "cache shard directory", "run `kernel-service verify --repair`")
            try:
                os.rename(staging, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Someone published first (or a broken leftover sits there).
                if self.lookup(key) is None:
                    os.rename(staging, final)
            sync(final.parent, directory=True)
        except (StoreError, UntrustedPath):
            self.discard_staging(staging)
            raise
        except OSError as exc:
            self.discard_staging(staging)
            raise StoreError(exc.errno, f"cannot publish cache entry {key[:16]} under {self.root}: {exc.strerror or exc}") from exc
        self.discard_staging(staging)  # no-op unless we lost a race
        entry = self.lookup(key)
        if entry is None:
            raise StoreError(errno.EIO, f"cache entry {key[:16]} failed verification right after publishing")
        for hook in self.on_publish if hooks else ():
            try:
                hook(entry)
            except Exception:  # noqa: BLE001 - sharing is an optimisation: the entry is published
                log.exception("a publish hook failed for %s", key[:16])
        return entry

    def remove(self, key: str) -> None:
        self._forget(key)
        self._remove_dir(self.entry_path(key))
        self.blobs.collect()

    # ----- the budget (store.budget): recency, and removal of what was not used since
    def evict(self, budget_: Budget, protect: str | None = None) -> int:
        return budget.evict(self, budget_, protect)

    def usage(self) -> tuple[int, int]:
        return budget.usage(self)

    def last_used(self, key: str) -> float:
        """When `key`'s entry was last used, at the latest: handed out by this store, or its
        directory's mtime (set at publish, touched on hits and by clients that load it
        themselves); where this store never handed it out (another daemon, `kernel-service
        prune`), up to TOUCH_EVERY past that mtime, and taken to be. Raises OSError when gone."""
        with self._lock:
            return self._last_used(key)

    def _last_used(self, key: str) -> float:
        mtime = self.entry_path(key).stat().st_mtime
        used = self._used.get(key)
        return max(used, mtime) if used is not None else mtime + TOUCH_EVERY

    def take_unused(self, key: str, cutoff: float) -> bool:
        """Removes `key`'s entry unless it was used after `cutoff`; whether it did. The check and
        the rename happen under the lock lookups mark use under, so a hit never gets an entry
        being evicted. Its blobs stay until `blobs.collect()`."""
        trash = self._trash(key)
        with self._lock:
            try:
                if self._last_used(key) > cutoff:
                    return False
                os.rename(self.entry_path(key), trash)
            except OSError:
                return False
            self._drop_records(key)
        remove_tree(trash)
        return True

    # ----- claims on builds: the scheduler is handed self.claims; the store closes them
    def close(self) -> None:
        """Finishes the claims' background work (the fleet tier's uploads, bounded) and lets go
        of what they hold for others."""
        self.claims.close()

    # ----- housekeeping
    def keys(self) -> list[str]:
        return list(self._walk_keys())

    def _walk_keys(self):
        """Keys as the directory walk finds them (lazily: asking whether there is any reads one shard)."""
        return (p.name for shard in self.entries_dir.iterdir() if real_dir(shard) for p in shard.iterdir() if real_dir(p))

    def records(self):
        """Every entry's key and entry.json, read without verifying the entry (explain only
        compares specs and toolchains; serving always goes through lookup)."""
        for key in self._walk_keys():
            try:
                meta = json.loads(read_owned(self.entry_path(key) / ENTRY_META, self.owner))
            except (OSError, ValueError):
                continue  # evicted meanwhile, or damaged: lookup deals with it
            if isinstance(meta, dict):
                yield key, meta

    def clean_staging(self) -> int:
        """Removes staging directories whose writer process is gone; returns how many.

        Only names this code makes, and only real directories of this uid: a link is
        never followed, anything else is left alone (verify reports it).
        """
        removed = 0
        for item in self.staging_dir.iterdir():
            if not is_staging_name(item.name) or writer_alive(item.name):
                continue
            try:
                st = item.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.owner:
                continue  # a link, a file, another user's: not ours to delete
            remove_tree(item)
            removed += 1
        return removed


def read_entry(key: str, path: Path, owner: int, trusted: tuple | None = None, spec: dict | None = None) -> tuple[Entry, tuple, tuple]:
    """(entry, its file names, their stat signature) of the entry at `path`, checked against its
    manifest (proto.entry's rules), its directories and files `owner`'s; raises OSError. It only
    reads: the read-only layers (store.layers) are checked by it too.

    Files whose stat signature equals `trusted` are not re-hashed.
    """
    check_dirs((path.parent, path), owner)  # a shard or entry dir replaced by a link is never followed
    library, files = read_manifest(read_owned(path / MANIFEST, owner), key)
    names = tuple(sorted(files))
    for name in names:
        st = os.lstat(path / name)
        why = problem(st, owner, stat.S_IFREG)
        if why:
            raise EntryRefused(f"{name} {why}")
        if st.st_size != files[name]["size"]:
            raise EntryRefused(f"{name} has {st.st_size} bytes, manifest says {files[name]['size']}")
    sig = signature(path, names)
    if sig != trusted:
        for name in names:
            if sha256_file(path / name) != files[name]["sha256"]:
                raise EntryRefused(f"{name} does not match its sha256 in the manifest")
    meta = read_meta(read_owned(path / ENTRY_META, owner, files[ENTRY_META]["size"]), spec)
    return Entry.of(key, path, library, files, meta), names, sig


def existing_mode(root: Path | str) -> int:
    """The mode a daemon gave an existing cache (0750 when configured group-shared), else 0700:
    a process other than the daemon opening the cache keeps it."""
    try:
        return 0o750 if os.stat(root).st_mode & 0o777 == 0o750 else 0o700
    except FileNotFoundError:
        return 0o700


def _no_sync(path: Path, directory: bool = False) -> None:
    """fsync_path's stand-in for an entry published without durability (LocalStore.put)."""


def is_staging_name(name: str) -> bool:
    """Whether `name` is one this code gives what it puts in staging/."""
    return STAGING_NAME.fullmatch(name) is not None


def writer_alive(name: str) -> bool:
    """Whether the process that made staging/`name` still runs."""
    owner = name.split(".", 1)[0]  # every staging name starts with its writer's pid
    return owner.isdigit() and (int(owner) == os.getpid() or pid_alive(int(owner)))
