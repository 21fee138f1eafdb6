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
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ENTRY_META = "entry.json"
MANIFEST_SCHEMA = 1


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


class Store:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.entries_dir = self.root / "entries"
        self.staging_dir = self.root / "staging"
        for d in (self.root, self.entries_dir, self.staging_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        # key -> stat signature of the manifest and library when last fully verified,
        # so hits re-hash only files that changed.
        self._verified: dict[str, tuple] = {}
        self._lock = threading.Lock()  # guards _verified only
        self.corrupt_found = 0

    # ----- paths
    def entry_path(self, key: str) -> Path:
        return self.entries_dir / key[:2] / key

    # ----- reading
    def lookup(self, key: str) -> Entry | None:
        """The verified entry for `key`, or None (missing, incomplete or corrupt: then removed)."""
        path = self.entry_path(key)
        if not path.is_dir():
            return None
        try:
            entry, signature = self._read_entry(key, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._discard_corrupt(key, path, str(exc))
            return None
        return entry

    def _read_entry(self, key: str, path: Path) -> tuple[Entry, tuple]:
        manifest_path = path / MANIFEST
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("key") != key:
            raise ValueError("manifest schema or key mismatch")
        files: dict = manifest["files"]
        library = manifest["library"]
        if library not in files or ENTRY_META not in files:
            raise ValueError("manifest does not list the library and entry.json")
        signature = []
        for name in sorted(files):
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{name} is not a regular file")
            if st.st_size != files[name]["size"]:
                raise ValueError(f"{name} has {st.st_size} bytes, manifest says {files[name]['size']}")
            signature.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        signature = tuple(signature)
        with self._lock:
            known = self._verified.get(key) == signature
        if not known:
            for name in sorted(files):
                if sha256_file(path / name) != files[name]["sha256"]:
                    raise ValueError(f"{name} does not match its sha256 in the manifest")
            with self._lock:
                self._verified[key] = signature
        meta = json.loads((path / ENTRY_META).read_text())
        entry = Entry(key, path, library, files[library]["sha256"], files[library]["size"], meta)
        return entry, signature

    def _discard_corrupt(self, key: str, path: Path, why: str) -> None:
        log.warning("cache entry %s is corrupt or incomplete (%s); removing it, it will be rebuilt", key[:16], why)
        self.corrupt_found += 1
        with self._lock:
            self._verified.pop(key, None)
        self._remove_dir(path)

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
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}.{key}.", dir=self.staging_dir))
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
                _fsync_path(item)
                files[item.name] = {"size": item.stat().st_size, "sha256": sha256_file(item)}
            if library not in files:
                raise StoreError(errno.ENOENT, f"the compiler produced no {library}")
            write_json_atomic(staging / MANIFEST, {"schema": MANIFEST_SCHEMA, "key": key, "library": library, "files": files})
            _fsync_path(staging, directory=True)
            final = self.entry_path(key)
            final.parent.mkdir(mode=0o700, exist_ok=True)
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
        with self._lock:
            self._verified.pop(key, None)
        self._remove_dir(self.entry_path(key))

    # ----- housekeeping
    def keys(self) -> list[str]:
        return [p.name for shard in self.entries_dir.iterdir() if shard.is_dir() for p in shard.iterdir() if p.is_dir()]

    def totals(self) -> tuple[int, int]:
        """(entries, bytes) on disk now."""
        entries = size = 0
        for shard in self.entries_dir.iterdir():
            for entry in shard.iterdir() if shard.is_dir() else ():
                entries += 1
                for f in entry.iterdir():
                    with contextlib.suppress(OSError):
                        size += f.lstat().st_size
        return entries, size

    def clean_staging(self) -> int:
        """Removes staging directories whose writer process is gone; returns how many."""
        removed = 0
        for item in self.staging_dir.iterdir():
            owner = item.name.split(".", 1)[0]  # every staging name starts with its writer's pid
            if owner.isdigit() and (int(owner) == os.getpid() or _alive(int(owner))):
                continue
            shutil.rmtree(item, ignore_errors=True)
            removed += 1
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
