"""The cache entry, defined once: its key, its files, its records, their checks and codecs.

An entry is one directory, <cache root>/entries/<key[:2]>/<key> (proto.paths), of
regular files:

    kernel.so       LIBRARY: the host shared object (the device binary embedded for CUDA)
    kernel.c/.cu    SOURCES: the generated source, kept for humans
    entry.json      ENTRY_META: spec, abi (proto.abi), toolchain, compile seconds, how it was built
    manifest.json   MANIFEST: {"schema": 1, "key": KEY, "library": LIBRARY,
                                "files": {name: {"size": N, "sha256": HEX}}}, every file but itself

It travels in two more encodings: the fleet tier's index in Redis (read_index;
entry.json inline as "meta", no manifest) and bundle.json's entries (read_bundle_entry).
Every reader (the store, verify, the client's loader, the fleet tier, bundle import)
checks what it reads with the functions here, and a failure is EntryRefused: the
entry is a miss, never served and never loaded. Keys and digests are 64 lowercase
hex characters; file names are plain names that cannot lead out of the entry, hide
(a leading dot) or read as an option (a leading dash). Light to import.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import abi
from .errors import EntryRefused
from .paths import entry_dir
from .trust import problem

__all__ = [
    "ENTRY_META",
    "HEX64",
    "INDEX_SCHEMA",
    "LIBRARY",
    "MANIFEST",
    "MANIFEST_SCHEMA",
    "RECORDS",
    "SOURCES",
    "Entry",
    "EntryRefused",
    "bundle_entry",
    "check_dirs",
    "check_files",
    "check_location",
    "check_meta",
    "index_record",
    "is_file_name",
    "is_key",
    "is_sha256",
    "location_dirs",
    "manifest_record",
    "read_bundle_entry",
    "read_index",
    "read_manifest",
    "read_meta",
    "signature",
]

LIBRARY = "kernel.so"
SOURCES = ("kernel.c", "kernel.cu")  # CPU, CUDA
ENTRY_META = "entry.json"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
RECORDS = (MANIFEST, ENTRY_META)  # the entry's own records: never blobs shared with another entry
INDEX_SCHEMA = 1  # the fleet tier's index (store.remote)

HEX64 = "[0-9a-f]{64}"  # a key, and a sha256: for patterns that embed one (staging names, messages)
_HEX64 = re.compile(HEX64)
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


# ----- the rules


def is_key(value) -> bool:
    """Whether `value` is a cache key: 64 lowercase hex characters (proto.keys.cache_key)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def is_sha256(value) -> bool:
    """Whether `value` is a file digest as entries record it: 64 lowercase hex characters."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def is_file_name(name) -> bool:
    """Whether `name` may name a file of an entry: 1-64 of A-Z a-z 0-9 . _ -, starting with a
    letter or digit (so no path, no "." or "..", nothing hidden, nothing read as an option)."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_files(files, library, *, with_meta: bool = True) -> int:
    """Checks an entry's table of files {name: {"size", "sha256"}} and its library's name;
    returns the bytes they hold. entry.json is listed (`with_meta`: a manifest, a bundle
    entry) or must not be (the fleet index carries it inline); the manifest never is.
    Raises EntryRefused."""
    if not isinstance(files, dict) or not isinstance(library, str) or library not in files or library in RECORDS:
        raise EntryRefused("its files do not include the library")
    if (ENTRY_META in files) != with_meta:
        raise EntryRefused(f"its files must {'' if with_meta else 'not '}include {ENTRY_META}")
    total = 0
    for name, f in files.items():
        if not is_file_name(name) or name == MANIFEST:
            raise EntryRefused(f"file name {name!r} is not a plain file name of an entry")
        if not isinstance(f, dict) or not _is_size(f.get("size")) or not is_sha256(f.get("sha256")):
            raise EntryRefused(f"{name}'s size or sha256 is malformed")
        total += f["size"]
    return total


def check_meta(meta, spec: dict | None = None) -> dict:
    """`meta` if it is an entry.json the servicer and the loader can use: a spec and a callable
    ABI, and, when `spec` is given, that spec (an entry for another kernel under a key is never
    served). Raises EntryRefused."""
    if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict) or not isinstance(meta.get("abi"), dict):
        raise EntryRefused(f"{ENTRY_META} lacks its spec or abi")
    try:
        abi.check(meta["abi"])
    except abi.AbiError as exc:
        raise EntryRefused(f"{ENTRY_META}'s {exc}") from None
    named = meta["abi"].get("files", {}) if meta["abi"]["loader"] == abi.PROGRAM else {}
    if not all(is_file_name(name) and name not in RECORDS for name in named.values()):
        raise EntryRefused(f"{ENTRY_META}'s abi.files names something other than a file of the entry")
    if spec is not None and meta["spec"] != spec:
        raise EntryRefused(f"{ENTRY_META} records spec {json.dumps(meta['spec'], sort_keys=True)[:200]}, not the one its key was computed from")
    return meta


def location_dirs(root: Path | str, key: str) -> tuple[Path, Path, Path, Path]:
    """The directories from the cache root down to `key`'s entry: root, entries/, the shard, the entry."""
    path = entry_dir(root, key)
    return Path(root), path.parent.parent, path.parent, path


def check_dirs(paths, owner: int) -> None:
    """Each of `paths` is a real directory (lstat: never a link) of `owner` that no one else may
    write; raises EntryRefused (FileNotFoundError when one is gone)."""
    for path in paths:
        why = problem(os.lstat(path), owner)
        if why:
            raise EntryRefused(f"{path} {why}; not using it")


def check_location(root: Path | str, path: Path | str, key: str, owner: int) -> Path:
    """`path` if it is where the cache at `root` (absolute) keeps entry `key`, and every directory
    from `root` down to it is one of `owner` that no one else may write; raises EntryRefused."""
    root, path = Path(root), Path(path)
    if not is_key(key) or not root.is_absolute() or path != entry_dir(root, key):
        raise EntryRefused(f"{path} is not where the daemon's cache {root} keeps entry {str(key)[:16]!r}; not loading from it")
    try:
        check_dirs(location_dirs(root, key), owner)
    except FileNotFoundError as exc:
        raise EntryRefused(f"cannot check {exc.filename}: {exc.strerror}") from None
    return path


# ----- the records, as stored


def _json(raw, what: str):
    try:
        return json.loads(raw)
    except (ValueError, TypeError) as exc:
        raise EntryRefused(f"{what} is not JSON ({exc})") from None


def manifest_record(key: str, library: str, files: dict) -> dict:
    """manifest.json's contents for an entry of `key`."""
    return {"schema": MANIFEST_SCHEMA, "key": key, "library": library, "files": files}


def read_manifest(raw: bytes | str, key: str) -> tuple[str, dict]:
    """(library, files) of manifest.json's bytes, once it checks as `key`'s; raises EntryRefused."""
    manifest = _json(raw, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("key") != key:
        raise EntryRefused(f"{MANIFEST}'s schema or key does not match")
    check_files(manifest.get("files"), manifest.get("library"))
    return manifest["library"], manifest["files"]


def read_meta(raw: bytes | str, spec: dict | None = None) -> dict:
    """entry.json's contents, checked (check_meta); raises EntryRefused."""
    return check_meta(_json(raw, ENTRY_META), spec)


def index_record(library: str, files: dict, meta: dict, host: str) -> dict:
    """The fleet tier's index of an entry (store.remote): its files but the records, entry.json
    inline, and the host that wrote it."""
    return {"schema": INDEX_SCHEMA, "host": host, "library": library, "files": files, "meta": meta}


def read_index(raw: bytes | str, spec: dict, max_bytes: int) -> tuple[str, dict, dict, str | None]:
    """(library, files, meta, host) of a fleet index, after every check a local entry must pass
    that can be made before its bytes are read: holding at most `max_bytes`, recording `spec`.
    Raises EntryRefused."""
    index = _json(raw, "the index")
    if not isinstance(index, dict) or index.get("schema") != INDEX_SCHEMA:
        raise EntryRefused("not an index of this schema")
    library, files = index.get("library"), index.get("files")
    total = check_files(files, library, with_meta=False)
    if total > max_bytes:
        raise EntryRefused(f"it holds {total} bytes, over the {max_bytes}-byte limit")
    meta = check_meta(index.get("meta"), spec)
    return library, files, dict(meta), index.get("host")


def bundle_entry(key: str, spec: dict, library: str, files: dict) -> dict:
    """One entry of bundle.json: its key, spec and files (entry.json among them, as a blob)."""
    return {"key": key, "spec": spec, "library": library, "files": files}


def read_bundle_entry(entry) -> tuple[str, str, dict]:
    """(key, library, files) of one of bundle.json's entries, checked; raises EntryRefused."""
    if not isinstance(entry, dict) or not is_key(entry.get("key")):
        raise EntryRefused("no key")
    check_files(entry.get("files"), entry.get("library"))
    return entry["key"], entry["library"], entry["files"]


# ----- one published entry, and what changes when it does


@dataclass(frozen=True)
class Entry:
    """One published kernel: where its files are, the library's digest, its entry.json."""

    key: str
    path: Path
    library: str
    library_sha256: str
    library_size: int
    meta: dict  # entry.json: spec, abi, compile_seconds, toolchain, created, shared_build, ...
    files: dict | None = None  # the manifest's {name: {"size", "sha256"}}, where it was read

    @classmethod
    def of(cls, key: str, path: Path, library: str, files: dict, meta: dict) -> Entry:
        return cls(key, path, library, files[library]["sha256"], files[library]["size"], meta, files)

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


def signature(path: Path, names) -> tuple:
    """What changes when any of the entry's files `names` or its manifest is replaced, truncated
    or rewritten (the ctime too: restoring the mtime after a write cannot restore it), or when
    the entry's directory or its shard is replaced (by a link, say). Linking a file to another
    entry changes its ctime as well: that costs one re-hash, never a wrong answer. Raises
    OSError when one is gone."""
    entry = os.fspath(path)  # strings, not Paths: this runs on every direct hit
    out = []
    for p in (os.path.dirname(entry), entry):
        st = os.lstat(p)
        out.append((st.st_ino, st.st_mode, st.st_uid))
    for name in (MANIFEST, *names):
        st = os.lstat(f"{entry}/{name}")
        out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid))
    return tuple(out)
