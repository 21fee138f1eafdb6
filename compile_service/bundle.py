"""Bundles: cache entries packed on one host, checked byte for byte and published on another.

A bundle is a tar archive (gzip-compressed when its name ends in .gz or .tgz)
of exactly these regular files:

    bundle.json       format, version, the toolchain its keys were made with, and per
                      entry: key, spec, library, files (name -> size, sha256): the
                      entry's own record (proto.entry.bundle_entry)
    blobs/<sha256>    each distinct file's bytes, once (a shared build's copies share
                      one library)

Entries embed their device binary in kernel.so, so the builder's
device-binaries/ (a compile-time cache of the device compiler) does not travel.

Import trusts nothing in the archive. Members are read one by one, never
extracted by name: only the names above, only regular files (no links of
either kind, devices, fifos or directories), each within a size bound and all
within a total, streamed into a private staging directory inside the cache
while their sha256 is computed. Then bundle.json is checked: every blob it
names is there with its digest, every entry's spec is valid here, its
toolchain is this host's (else the import is refused, naming the field), and
its key, recomputed here, is the one it travels under. Only then is each entry
published, whole or not at all, through the store's put().
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import kernels
from kernels.spec import CanonicalSpec, InvalidSpec
from proto.entry import ENTRY_META, HEX64, MANIFEST, EntryRefused, bundle_entry, read_bundle_entry, read_manifest, read_meta
from proto.trust import read_owned

from . import __version__
from .fsutil import sha256_file
from .keys import cache_key, fingerprint, toolchain
from .store import LocalStore, StoreError

FORMAT = "kernel-service-bundle"
VERSION = 1
INDEX = "bundle.json"
MAX_MEMBER = 256 << 20  # bytes of one file: a kernel library is a few MB
MAX_TOTAL = 8 << 30  # bytes of all files
MAX_MEMBERS = 200_000
MAX_INDEX = 64 << 20  # bytes of bundle.json
HEADER_SLACK = 64 << 20  # tar headers (pax included) read on top of the files' bytes

_BLOB = re.compile(rf"blobs/({HEX64})")
_TYPES = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.DIRTYPE: "a directory",
    tarfile.CONTTYPE: "a contiguous file",
}


class BundleError(Exception):
    """A bundle that cannot be written or imported; the message names the problem and the fix."""


def shared_toolchain(cuda_compiler: str) -> dict:
    """The toolchain parts every entry of a bundle shares (each kind's source digest is in its
    entry's own toolchain): what bundle.json records and an importer checks first."""
    return {part: value for part, value in fingerprint(cuda_compiler).items() if part != "kind_sources"}


# ----- export


def export(store: LocalStore, specs: list[CanonicalSpec], cuda_compiler: str, out: Path) -> dict:
    """Packs the entries of `specs` (keyed with device compiler id `cuda_compiler`) into `out`,
    written whole or not at all. Returns {entries, blobs, bytes}. Raises BundleError when
    some are not in the cache."""
    entries, blobs, missing = {}, {}, []
    for spec in with_routes(specs):
        key = cache_key(spec, cuda_compiler)
        entry = store.lookup(key, json.loads(spec.to_json()))  # verified against its manifest
        if entry is None:
            missing.append(spec.to_json())
            continue
        _, files = read_manifest(read_owned(entry.path / MANIFEST, store.owner), key)
        entries[key] = bundle_entry(key, entry.meta["spec"], entry.library, files)
        for name, f in files.items():
            blobs[f["sha256"]] = (entry.path / name, f["size"])
    if missing:
        shown = "\n  ".join(missing[:10]) + (f"\n  ... and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise BundleError(
            f"{len(missing)} of the manifest's {len(specs)} kernels are not in the cache {store.root} "
            f"(CUDA keys with compiler {cuda_compiler}); build them first with `kernel-service prewarm MANIFEST` "
            f"against a daemon on this cache:\n  {shown}"
        )
    index = {
        "format": FORMAT,
        "version": VERSION,
        "kernel_service": __version__,
        "created": time.time(),
        "toolchain": shared_toolchain(cuda_compiler),
        "entries": sorted(entries.values(), key=lambda e: e["key"]),
    }
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz" if out.name.endswith((".gz", ".tgz")) else "w") as tar:
            _add(tar, INDEX, io.BytesIO(json.dumps(index, indent=1, sort_keys=True).encode()))
            for sha, (path, size) in sorted(blobs.items()):
                with open(path, "rb") as f:
                    _add(tar, f"blobs/{sha}", f, size)
        os.chmod(tmp, 0o644)  # kernels and their digests: nothing secret, meant to be copied into images
        os.replace(tmp, out)
    except OSError as exc:
        raise BundleError(f"cannot write the bundle {out}: {exc.strerror or exc} (an entry evicted meanwhile? run the export again)") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return {"entries": len(entries), "blobs": len(blobs), "bytes": out.stat().st_size}


def with_routes(specs: list[CanonicalSpec]) -> list[CanonicalSpec]:
    """`specs` and, after each router (KernelKind.dispatch), the builds it routes to: a serving
    host loads those too."""
    out: dict[str, CanonicalSpec] = {}
    for spec in specs:
        routes = kernels.get_kind(spec.kind).routes(spec)
        for s in [spec, *(build for _, build in routes[1])] if routes else [spec]:
            out.setdefault(s.to_json(), s)
    return list(out.values())


def _add(tar: tarfile.TarFile, name: str, data, size: int | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data.getvalue()) if size is None else size
    info.mode = 0o644
    tar.addfile(info, data)


# ----- import


@dataclass
class ImportReport:
    imported: int = 0  # entries published by this import
    present: int = 0  # entries the cache already had
    digests_checked: int = 0  # files whose sha256 was checked (each blob once)
    bytes: int = 0  # bytes of the files read


def import_(store: LocalStore, bundle: Path, cuda_compiler: str, max_member: int = MAX_MEMBER, max_total: int = MAX_TOTAL) -> ImportReport:
    """Checks everything in `bundle` against this host (keys with device compiler id
    `cuda_compiler`), then publishes its entries into `store`. Raises BundleError, having
    published nothing, when any check fails; StoreError when the cache refuses a write."""
    work = store.new_staging("import")  # <pid>.import.<random>: swept, as any staging, if we die
    try:
        report = ImportReport()
        index, blobs = _unpack(Path(bundle), work, max_member, max_total, report)
        entries = _check(index, blobs, cuda_compiler, Path(bundle).name)
        for entry, meta in entries:
            if store.lookup(entry["key"], meta["spec"]) is not None:
                report.present += 1
                continue
            staging = store.new_staging(entry["key"])
            try:
                for name, f in entry["files"].items():
                    if name != ENTRY_META:  # put() writes entry.json from `meta`
                        os.link(blobs[f["sha256"]], staging / name)
            except OSError as exc:
                store.discard_staging(staging)
                raise StoreError(exc.errno, f"cannot stage entry {entry['key'][:16]}: {exc.strerror or exc}") from exc
            store.put(entry["key"], staging, entry["library"], meta)
            report.imported += 1
        return report
    finally:
        store.discard_staging(work)


class _Bounded(io.RawIOBase):
    """A reader that refuses to yield more than `limit` bytes: a decompression bomb, or a
    header claiming more than the members' bound, stops here."""

    def __init__(self, raw, limit: int, name: str):
        self.raw, self.left, self.name = raw, limit, name

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(min(len(buffer), self.left + 1))
        if len(data) > self.left:
            raise BundleError(f"{self.name}: more than {self.left} bytes once unpacked; not a bundle this host accepts (oversized)")
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def _describe(member: tarfile.TarInfo) -> str | None:
    """What is wrong with a member's type or name, or None."""
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
        return f"is {_TYPES.get(member.type, 'not a regular file')}; a bundle holds only regular files"
    name = member.name
    if name.startswith("/") or re.match(r"[A-Za-z]:[\\/]", name):
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", name):
        return "leads out of the bundle (path traversal)"
    if name != INDEX and not _BLOB.fullmatch(name):
        return f"is not a bundle file (only {INDEX} and blobs/<sha256>)"
    return None


def _unpack(path: Path, work: Path, max_member: int, max_total: int, report: ImportReport) -> tuple[dict, dict[str, Path]]:
    """Streams the members into `work`, checking type, name, size and digest of each;
    returns bundle.json's contents and sha256 -> file."""
    blobs: dict[str, Path] = {}
    index = None
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise BundleError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    with raw:
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream = gzip.GzipFile(fileobj=raw) if compressed else raw
        try:
            with tarfile.open(fileobj=io.BufferedReader(_Bounded(stream, max_total + HEADER_SLACK, str(path))), mode="r|") as tar:
                for count, member in enumerate(tar, 1):
                    problem = _describe(member)
                    if problem:
                        raise BundleError(f"{path}: member {member.name!r} {problem}; refusing the whole bundle")
                    if count > MAX_MEMBERS:
                        raise BundleError(f"{path}: more than {MAX_MEMBERS} members; refusing the whole bundle (oversized)")
                    limit = MAX_INDEX if member.name == INDEX else max_member
                    if member.size > limit:
                        raise BundleError(f"{path}: member {member.name!r} has {member.size} bytes, at most {limit} are accepted (oversized)")
                    report.bytes += member.size
                    if report.bytes > max_total:
                        raise BundleError(f"{path}: more than {max_total} bytes of files in all; refusing the whole bundle (oversized)")
                    target = work / (INDEX if member.name == INDEX else member.name.split("/")[1])
                    if target.exists():
                        raise BundleError(f"{path}: member {member.name!r} appears twice; refusing the whole bundle")
                    _copy(tar.extractfile(member), target, member.size, path, member.name)
                    if member.name == INDEX:
                        index = target
                        continue
                    sha = member.name.split("/")[1]
                    if sha256_file(target) != sha:
                        raise BundleError(f"{path}: {member.name} does not match its sha256 (damaged or tampered with); refusing the whole bundle")
                    report.digests_checked += 1
                    blobs[sha] = target
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise BundleError(f"{path}: not a readable bundle ({type(exc).__name__}: {exc})") from None
    if index is None:
        raise BundleError(f"{path}: no {INDEX}; not a kernel-service bundle (make one with `kernel-service bundle export`)")
    try:
        return json.loads(index.read_text()), blobs
    except ValueError as exc:
        raise BundleError(f"{path}: {INDEX} is not JSON ({exc})") from None


def _copy(source, target: Path, size: int, path: Path, name: str) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    written = 0
    with os.fdopen(fd, "wb") as out:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            written += len(chunk)
            if written > size:
                break
            out.write(chunk)
    if written != size:
        raise BundleError(f"{path}: member {name!r} holds {written} bytes, its header says {size}; refusing the whole bundle")


def _check(index, blobs: dict[str, Path], cuda_compiler: str, name: str) -> list[tuple[dict, dict]]:
    """bundle.json's entries with their metadata, once every check passed; raises BundleError."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"{name}: {INDEX} is not a kernel-service bundle index")
    if index.get("version") != VERSION:
        raise BundleError(f"{name}: bundle version {index.get('version')!r}; this kernel-service reads version {VERSION}")
    entries = index.get("entries")
    if not isinstance(entries, list) or not isinstance(index.get("toolchain"), dict):
        raise BundleError(f"{name}: {INDEX} lacks its entries or toolchain")
    cuda = any(isinstance(e, dict) and isinstance(e.get("spec"), dict) and str(e["spec"].get("target", "c")) != "c" for e in entries)
    _same_toolchain(index["toolchain"], shared_toolchain(cuda_compiler), cuda, name)
    used, keys, out = set(), set(), []
    for i, entry in enumerate(entries):
        where = f"{name}: entries[{i}]"
        try:
            key, _library, files = read_bundle_entry(entry)
        except EntryRefused as exc:
            raise BundleError(f"{where}: {exc}") from None
        if key in keys:
            raise BundleError(f"{where}: a key seen twice")
        keys.add(key)
        for file, f in files.items():
            if f["sha256"] not in blobs or os.stat(blobs[f["sha256"]]).st_size != f["size"]:
                raise BundleError(f"{where}: file {file} names no blob of the bundle with its size and sha256")
            used.add(f["sha256"])
        try:
            meta = read_meta(blobs[files[ENTRY_META]["sha256"]].read_bytes())
        except EntryRefused as exc:
            raise BundleError(f"{where}: its {ENTRY_META} is not valid ({exc})") from None
        spec = _spec_here(meta["spec"], where)
        if meta["spec"] != entry.get("spec"):
            raise BundleError(f"{where}: {INDEX} and the entry's {ENTRY_META} record different specs")
        here = toolchain(spec.kind, spec.target.kind, cuda_compiler)
        _same_toolchain(meta.get("toolchain") or {}, here, True, f"{where} ({spec.kind})")
        if cache_key(spec, cuda_compiler) != entry["key"]:
            raise BundleError(f"{where}: its key is not the one this host computes for its spec and toolchain; refusing the whole bundle")
        out.append((entry, meta))
    unused = sorted(set(blobs) - used)
    if unused:
        raise BundleError(f"{name}: blobs/{unused[0]} belongs to no entry; a bundle holds exactly its entries' files")
    return out


def _spec_here(spec: dict, where: str) -> CanonicalSpec:
    """The recorded spec, validated by this host's kinds; it must already be canonical."""
    try:
        canonical = kernels.canonicalize(spec.get("kind"), dict(spec.get("params") or {}), spec.get("target"))
    except InvalidSpec as exc:
        raise BundleError(f"{where}: its spec is not valid here ({exc}); a plugin kind needs --kernel-module") from None
    if json.loads(canonical.to_json()) != spec:
        raise BundleError(f"{where}: its spec is not canonical here (other defaults: another kernel-service version?)")
    return canonical


def _same_toolchain(bundle: dict, host: dict, cuda: bool, where: str) -> None:
    """Refuses a toolchain other than this host's, naming every field that differs."""
    differ = [part for part in host if (part != "cuda_compiler" or cuda) and bundle.get(part) != host[part]]
    if not differ:
        return
    shown = ", ".join(f"{'cuda' if p == 'cuda_compiler' else p} {bundle.get(p)} (bundle) vs {host[p]} (this host)" for p in differ)
    hint = "its keys would never be looked up here; rebuild it with this host's toolchain"
    if differ == ["cuda_compiler"]:
        hint = (
            f"a host that does not compile serves it with the builder's compiler id: "
            f"`kernel-service bundle import --cuda-compiler-id {bundle.get('cuda_compiler')} ...` and "
            f"`kernel-service serve --no-compile --cuda-compiler-id {bundle.get('cuda_compiler')}`"
        )
    raise BundleError(f"{where}: built with another toolchain: {shown}; {hint}")
