"""Bundles: cache entries packed on one host, checked byte for byte and published on another.

A bundle is a tar archive (xz-compressed when its name ends in .xz or .txz, gzip
for .gz or .tgz; import reads either, and plain tar, whatever the name) of
exactly these regular files, in this order:

    bundle.json       format, version, the toolchain its keys were made with, and per
                      entry: key, spec, library, files (name -> size, sha256): the
                      entry's own record (proto.entry.bundle_entry)
    bundle.sig        optional: the exporter's Ed25519 signature over bundle.json
                      (compile_service.provenance)
    blobs/<sha256>    each distinct file's bytes, once (a shared build's copies share
                      one library)

Entries embed their device binary in kernel.so, so the builder's
device-binaries/ (a compile-time cache of the device compiler) does not travel.

Import trusts nothing in the archive. The file must be one no other user could
have written, and signed by a trusted key unless the importer says it trusts
unsigned bundles (Policy; provenance checks both), decided before any file of
it is stored. Members are read one by one, never extracted by name: only the
names above, only regular files (no links of either kind, devices, fifos or
directories), each within a size bound and all within a total, streamed into a
private staging directory inside the cache while their sha256 is computed. Then
bundle.json is checked: every blob it names is there with its digest, every
entry's spec is valid here and for an arch this host runs, its toolchain is
this host's (else the import is refused, naming the field), and its key,
recomputed here, is the one it travels under. Only then is each entry
published, whole or not at all, through the store's put(). `verify` makes every
one of these checks and publishes nothing; `info` reads only bundle.json.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import lzma
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import kernels
from kernels.spec import CanonicalSpec, InvalidSpec, Target, detect_local_target
from proto.entry import ENTRY_META, HEX64, MANIFEST, EntryRefused, bundle_entry, read_bundle_entry, read_manifest, read_meta
from proto.jsondepth import load_json
from proto.trust import NotRegularFile, open_regular, read_owned

from . import __version__
from . import provenance as prov
from .fsutil import sha256_file
from .keys import cache_key, fingerprint, toolchain
from .store import LocalStore, StoreError

FORMAT = "kernel-service-bundle"
VERSION = 2  # 2: may hold bundle.sig, may be xz-compressed
READS = (1, 2)  # versions import reads: 1 is what kernel-service wrote before signatures
XZ_PRESET = 6  # docs/measured.md#bundle-size-and-codec: xz 6 against gzip and zstd on the zoo's sm_90a entries
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


@dataclass(frozen=True)
class Policy:
    """What an import accepts beyond the checks every bundle passes: whose signatures, and
    which arches. The default accepts only bundles signed by a trusted key (none given: none)."""

    trusted_keys: tuple = ()  # Ed25519 public keys (provenance.load_trusted_keys)
    trust_unsigned: bool = False  # also accept a bundle no trusted key signed (--trust-unsigned)
    host_target: str | None = None  # the CUDA arch this host runs (--target); None: its GPU's, by nvidia-smi
    any_arch: bool = False  # accept kernels for arches this host cannot run (--any-arch)


def runs_on(arch: str, host: Target) -> bool:
    """Whether a kernel built for target `arch` runs on a host whose GPU is `host`: the CPU target
    always; a CUDA binary on the same major version, no newer minor, and an arch-specific one
    (sm_90a) only on exactly its compute capability."""
    if arch == "c":
        return True
    built = kernels.parse_target(arch)
    if host.is_cpu:
        return False
    if built.arch.endswith("a"):
        return built.compute_capability == host.compute_capability
    return built.compute_capability // 10 == host.compute_capability // 10 and built.compute_capability <= host.compute_capability


def shared_toolchain(cuda_compiler: str) -> dict:
    """The toolchain parts every entry of a bundle shares (each kind's source digest is in its
    entry's own toolchain): what bundle.json records and an importer checks first."""
    return {part: value for part, value in fingerprint(cuda_compiler).items() if part != "kind_sources"}


# ----- export


def export(store: LocalStore, specs: list[CanonicalSpec], cuda_compiler: str, out: Path, signing_key=None, target: str | None = None) -> dict:
    """Packs the entries of `specs` (keyed with device compiler id `cuda_compiler`; only those
    for `target` when given) into `out`, signed with `signing_key` (an Ed25519 private key) when
    given, written whole or not at all. Returns {entries, blobs, bytes, signed_by}. Raises
    BundleError when some are not in the cache, or none is for `target`."""
    if target is not None:
        wanted = [s for s in specs if str(s.target) == target]
        if not wanted:
            listed = ", ".join(sorted({str(s.target) for s in specs})) or "none"
            raise BundleError(f"the manifest lists no kernel for target {target} (its targets: {listed})")
        specs = wanted
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
    index_bytes = json.dumps(index, indent=1, sort_keys=True).encode()
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with _open_for_writing(tmp, out.name) as tar:
            _add(tar, INDEX, index_bytes)
            if signing_key is not None:
                _add(tar, prov.SIGNATURE, prov.sign(signing_key, index_bytes))
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
    signed_by = prov.key_id(signing_key.public_key()) if signing_key is not None else None
    return {"entries": len(entries), "blobs": len(blobs), "bytes": out.stat().st_size, "signed_by": signed_by}


def _open_for_writing(path: str, name: str) -> tarfile.TarFile:
    """The archive, compressed as the bundle's name says: .xz/.txz xz, .gz/.tgz gzip, else none."""
    if name.endswith((".xz", ".txz")):
        return tarfile.open(path, "w:xz", preset=XZ_PRESET)
    return tarfile.open(path, "w:gz" if name.endswith((".gz", ".tgz")) else "w")


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
    if isinstance(data, bytes):
        data, size = io.BytesIO(data), len(data)
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    tar.addfile(info, data)


# ----- import


@dataclass
class ImportReport:
    imported: int = 0  # entries published by this import
    present: int = 0  # entries the cache already had
    digests_checked: int = 0  # files whose sha256 was checked (each blob once)
    bytes: int = 0  # bytes of the files read
    entries: int = 0  # entries the bundle holds
    provenance: str = ""  # who signed it, and why it was accepted
    arches: dict = field(default_factory=dict)  # target -> entries


def import_(
    store: LocalStore, bundle: Path, cuda_compiler: str, policy: Policy = Policy(), max_member: int = MAX_MEMBER, max_total: int = MAX_TOTAL
) -> ImportReport:
    """Checks everything in `bundle` against this host (keys with device compiler id
    `cuda_compiler`) and `policy`, then publishes its entries into `store`. Raises BundleError,
    having published nothing, when any check fails; StoreError when the cache refuses a write."""
    work = store.new_staging("import")  # <pid>.import.<random>: swept, as any staging, if we die
    try:
        report, entries, blobs = _read(Path(bundle), work, cuda_compiler, policy, max_member, max_total)
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


def import_layer(layer: Path, bundle: Path, cuda_compiler: str, policy: Policy = Policy()) -> ImportReport:
    """Lays `bundle` out as a read-only cache layer at `layer`: a cache root as LocalStore writes
    it, then every directory 0555 and file 0444, ready to bake into an image. `layer` must not
    exist or be an empty directory; on any failure nothing of it is left."""
    layer = Path(layer)
    made = not os.path.lexists(layer)
    if not made and (layer.is_symlink() or not layer.is_dir() or any(os.scandir(layer))):
        raise BundleError(f"--layer {layer}: exists and is not an empty directory; a layer is made whole, in a new directory (choose another path)")
    try:
        report = import_(LocalStore(layer), bundle, cuda_compiler, policy)
        _read_only(layer)
        return report
    except BaseException:
        if made:
            shutil.rmtree(layer, ignore_errors=True)
        else:
            for child in layer.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        raise


def _read_only(root: Path) -> None:
    """Directories 0555, files 0444, deepest first (the tree is ours and new: no links in it)."""
    for where, dirs, files in os.walk(root, topdown=False):
        for name in files:
            os.chmod(os.path.join(where, name), 0o444)
        for name in dirs:
            os.chmod(os.path.join(where, name), 0o555)
    os.chmod(root, 0o555)


def verify(bundle: Path, cuda_compiler: str, policy: Policy = Policy(), max_member: int = MAX_MEMBER, max_total: int = MAX_TOTAL) -> ImportReport:
    """Every check import makes (file, signature, digests, toolchain, keys, arches), in a
    private temporary directory, publishing nothing; raises BundleError."""
    with tempfile.TemporaryDirectory(prefix="kernel-service-verify-") as work:
        report, _entries, _blobs = _read(Path(bundle), Path(work), cuda_compiler, policy, max_member, max_total)
    return report


def info(bundle: Path) -> dict:
    """What bundle.json says a bundle holds, without checking its files or who made it:
    {format, version, compression, bytes, signed_by, toolchain, files, file_bytes (distinct
    files), entries: [{kind, target, params, bytes}], by_kind, by_arch} (an entry's bytes: all
    its files, so a file entries share counts in each; by_*: entries and bytes)."""
    path = Path(bundle)
    try:
        raw = os.fdopen(open_regular(path, "bundle"), "rb")
    except NotRegularFile as exc:
        raise BundleError(str(exc)) from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    with raw:
        compression = _compression(raw)
        index_bytes, signature = _head(raw, path)
    index = _index(index_bytes, path.name)
    signed_by = None
    if signature is not None:
        try:
            signed_by = prov.key_id(prov.signer(signature, index_bytes))
        except prov.ProvenanceError as exc:
            signed_by = f"INVALID: {exc}"
    rows, distinct = [], {}
    for i, e in enumerate(index["entries"]):
        try:
            read_bundle_entry(e)
        except EntryRefused as exc:
            raise BundleError(f"{path.name}: entries[{i}]: {exc}") from None
        distinct.update((f["sha256"], f["size"]) for f in e["files"].values())
        spec = e.get("spec") if isinstance(e.get("spec"), dict) else {}
        rows.append(
            {
                "kind": str(spec.get("kind")),
                "target": str(spec.get("target")),
                "params": spec.get("params") if isinstance(spec.get("params"), dict) else {},
                "bytes": sum(f["size"] for f in e["files"].values()),
            }
        )
    out = {
        "path": str(path),
        "format": index["format"],
        "version": index["version"],
        "kernel_service": index.get("kernel_service"),
        "compression": compression,
        "bytes": path.stat().st_size,
        "signed_by": signed_by,
        "toolchain": index["toolchain"],
        "files": len(distinct),
        "file_bytes": sum(distinct.values()),
        "entries": rows,
    }
    for group in ("kind", "target"):
        totals: dict = {}
        for row in rows:
            t = totals.setdefault(row[group], {"entries": 0, "bytes": 0})
            t["entries"] += 1
            t["bytes"] += row["bytes"]
        out["by_kind" if group == "kind" else "by_arch"] = dict(sorted(totals.items()))
    return out


def _read(path: Path, work: Path, cuda_compiler: str, policy: Policy, max_member: int, max_total: int) -> tuple[ImportReport, list, dict]:
    """The bundle's checked entries and blobs, unpacked into `work`, once every check passed."""
    report = ImportReport()
    try:
        fd = prov.open_trusted(path, "bundle")
    except prov.ProvenanceError as exc:
        raise BundleError(str(exc)) from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot read it: {exc.strerror or exc}") from None

    def trust(index: bytes, signature: bytes | None) -> None:
        report.provenance = _provenance(index, signature, policy, path)

    with os.fdopen(fd, "rb") as raw:
        index, blobs = _unpack(raw, path, work, max_member, max_total, report, trust)
    entries = _check(index, blobs, cuda_compiler, path.name)
    report.entries = len(entries)
    report.arches = dict(Counter(str(meta["spec"]["target"]) for _, meta in entries))
    _check_arches(report.arches, policy, path.name)
    return report, entries, blobs


def _provenance(index: bytes, signature: bytes | None, policy: Policy, path: Path) -> str:
    """Why this bundle may be imported, or BundleError: a signature must verify, and come from a
    trusted key unless unsigned bundles are trusted."""
    if signature is None:
        if policy.trust_unsigned:
            return "unsigned, accepted by --trust-unsigned"
        raise BundleError(
            f"{path}: not signed, and unsigned bundles are not trusted: import it only if you trust whoever made it "
            f"(--trust-unsigned), or have it exported with a signing key and pass that key's public half as --trusted-key "
            f"(or ${prov.TRUSTED_KEYS_ENV})"
        )
    try:
        key = prov.signer(signature, index)
    except prov.ProvenanceError as exc:
        raise BundleError(f"{path}: {exc}") from None
    if prov.is_trusted(key, policy.trusted_keys):
        return f"signed by {prov.key_id(key)}, a trusted key"
    if policy.trust_unsigned:
        return f"signed by {prov.key_id(key)}, not a trusted key; accepted by --trust-unsigned"
    given = f"the {len(policy.trusted_keys)} trusted keys given" if policy.trusted_keys else "no trusted key was given"
    raise BundleError(
        f"{path}: signed by {prov.key_id(key)}, which is not a trusted key ({given}); if you trust its builder, pass its public key "
        f"(`kernel-service bundle key` there) as --trusted-key (or ${prov.TRUSTED_KEYS_ENV})"
    )


def _check_arches(arches: dict, policy: Policy, name: str) -> None:
    if policy.any_arch:
        return
    host = kernels.parse_target(policy.host_target) if policy.host_target else detect_local_target()
    foreign = sorted(a for a in arches if not runs_on(a, host))
    if foreign:
        here = f"its GPU is {host}" if not host.is_cpu else "it has no GPU that nvidia-smi sees, so only target c"
        raise BundleError(
            f"{name}: holds kernels for {', '.join(foreign)}, which this host cannot run ({here}{' (--target)' if policy.host_target else ''}); "
            f"on a builder that serves them without running them (a CPU-only builder, an image build) pass --target {foreign[0]} or --any-arch"
        )


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


_MAGIC = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz"}


def _compression(raw) -> str:
    """gzip, xz or none, from the file's first bytes (its name says nothing an importer trusts)."""
    head = raw.read(6)
    raw.seek(0)
    return next((codec for magic, codec in _MAGIC.items() if head.startswith(magic)), "none")


def _tar(raw, path: Path, limit: int) -> tarfile.TarFile:
    """The archive in `raw`, decompressed, read as a stream of at most `limit` bytes."""
    codec = _compression(raw)
    stream = gzip.GzipFile(fileobj=raw) if codec == "gzip" else lzma.LZMAFile(raw) if codec == "xz" else raw
    return tarfile.open(fileobj=io.BufferedReader(_Bounded(stream, limit, str(path))), mode="r|")


_UNREADABLE = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


def _describe(member: tarfile.TarInfo) -> str | None:
    """What is wrong with a member's type or name, or None."""
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
        return f"is {_TYPES.get(member.type, 'not a regular file')}; a bundle holds only regular files"
    name = member.name
    if name.startswith("/") or re.match(r"[A-Za-z]:[\\/]", name):
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", name):
        return "leads out of the bundle (path traversal)"
    if name not in (INDEX, prov.SIGNATURE) and not _BLOB.fullmatch(name):
        return f"is not a bundle file (only {INDEX}, {prov.SIGNATURE} and blobs/<sha256>)"
    return None


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> bytes:
    data = tar.extractfile(member).read(member.size + 1)
    if len(data) != member.size:
        raise BundleError(f"{path}: member {member.name!r} holds {len(data)} bytes, its header says {member.size}; refusing the whole bundle")
    return data


def _head(raw, path: Path) -> tuple[bytes, bytes | None]:
    """bundle.json's bytes and bundle.sig's (None: unsigned), the archive's first members."""
    index = signature = None
    try:
        with _tar(raw, path, MAX_INDEX + prov.MAX_KEY_FILE + HEADER_SLACK) as tar:
            for member in tar:
                problem = _describe(member)
                if problem:
                    raise BundleError(f"{path}: member {member.name!r} {problem}")
                if member.name == INDEX and index is None and member.size <= MAX_INDEX:
                    index = _read_small(tar, member, path)
                elif member.name == prov.SIGNATURE and index is not None and signature is None and member.size <= prov.MAX_KEY_FILE:
                    signature = _read_small(tar, member, path)
                else:
                    break
    except _UNREADABLE as exc:
        raise BundleError(f"{path}: not a readable bundle ({type(exc).__name__}: {exc})") from None
    if index is None:
        raise BundleError(f"{path}: no {INDEX} first; not a kernel-service bundle (make one with `kernel-service bundle export`)")
    return index, signature


def _unpack(raw, path: Path, work: Path, max_member: int, max_total: int, report: ImportReport, trust) -> tuple[dict, dict[str, Path]]:
    """Streams the members of the open bundle `raw` into `work`, checking type, name, size and
    digest of each; `trust(index, signature)` decides on bundle.json and bundle.sig before any
    other file is stored. Returns bundle.json's contents and sha256 -> file."""
    blobs: dict[str, Path] = {}
    index = signature = None
    trusted = False
    try:
        with _tar(raw, path, max_total + HEADER_SLACK) as tar:
            for count, member in enumerate(tar, 1):
                problem = _describe(member)
                if problem:
                    raise BundleError(f"{path}: member {member.name!r} {problem}; refusing the whole bundle")
                if count > MAX_MEMBERS:
                    raise BundleError(f"{path}: more than {MAX_MEMBERS} members; refusing the whole bundle (oversized)")
                limit = {INDEX: MAX_INDEX, prov.SIGNATURE: prov.MAX_KEY_FILE}.get(member.name, max_member)
                if member.size > limit:
                    raise BundleError(f"{path}: member {member.name!r} has {member.size} bytes, at most {limit} are accepted (oversized)")
                report.bytes += member.size
                if report.bytes > max_total:
                    raise BundleError(f"{path}: more than {max_total} bytes of files in all; refusing the whole bundle (oversized)")
                if member.name == INDEX:
                    if index is not None:
                        raise BundleError(f"{path}: member {member.name!r} appears twice; refusing the whole bundle")
                    index = _read_small(tar, member, path)
                    continue
                if member.name == prov.SIGNATURE:
                    if index is None or signature is not None or trusted:
                        raise BundleError(f"{path}: {prov.SIGNATURE} must come once, right after {INDEX}; refusing the whole bundle")
                    signature = _read_small(tar, member, path)
                    continue
                if index is None:
                    raise BundleError(f"{path}: no {INDEX} before its files; not a kernel-service bundle (make one with `kernel-service bundle export`)")
                if not trusted:
                    trust(index, signature)
                    trusted = True
                sha = member.name.split("/")[1]
                target = work / sha
                if target.exists():
                    raise BundleError(f"{path}: member {member.name!r} appears twice; refusing the whole bundle")
                _copy(tar.extractfile(member), target, member.size, path, member.name)
                if sha256_file(target) != sha:
                    raise BundleError(f"{path}: {member.name} does not match its sha256 (damaged or tampered with); refusing the whole bundle")
                report.digests_checked += 1
                blobs[sha] = target
    except _UNREADABLE as exc:
        raise BundleError(f"{path}: not a readable bundle ({type(exc).__name__}: {exc})") from None
    if index is None:
        raise BundleError(f"{path}: no {INDEX}; not a kernel-service bundle (make one with `kernel-service bundle export`)")
    if not trusted:
        trust(index, signature)
    return _index(index, path.name), blobs


def _index(raw: bytes, name: str) -> dict:
    """bundle.json's contents, once its shape is one this host reads; raises BundleError."""
    try:
        index = load_json(raw)
    except ValueError as exc:
        raise BundleError(f"{name}: {INDEX} is not JSON this host reads ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"{name}: {INDEX} is not a kernel-service bundle index")
    if index.get("version") not in READS:
        raise BundleError(f"{name}: bundle version {index.get('version')!r}; this kernel-service reads versions {', '.join(map(str, READS))}")
    if not isinstance(index.get("entries"), list) or not isinstance(index.get("toolchain"), dict):
        raise BundleError(f"{name}: {INDEX} lacks its entries or toolchain")
    return index


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


def _check(index: dict, blobs: dict[str, Path], cuda_compiler: str, name: str) -> list[tuple[dict, dict]]:
    """bundle.json's entries with their metadata, once every check passed; raises BundleError."""
    entries = index["entries"]
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
        recorded = meta.get("toolchain")
        _same_toolchain(recorded if isinstance(recorded, dict) else {}, here, True, f"{where} ({spec.kind})")
        if cache_key(spec, cuda_compiler) != entry["key"]:
            raise BundleError(f"{where}: its key is not the one this host computes for its spec and toolchain; refusing the whole bundle")
        out.append((entry, meta))
    unused = sorted(set(blobs) - used)
    if unused:
        raise BundleError(f"{name}: blobs/{unused[0]} belongs to no entry; a bundle holds exactly its entries' files")
    return out


def _spec_here(spec: dict, where: str) -> CanonicalSpec:
    """The recorded spec, validated by this host's kinds; it must already be canonical."""
    if not isinstance(spec.get("params"), dict):
        raise BundleError(f"{where}: its spec's params are not an object")
    try:
        canonical = kernels.canonicalize(spec.get("kind"), dict(spec["params"]), spec.get("target"))
    except (InvalidSpec, TypeError) as exc:  # TypeError: a value of no type a parameter takes (a list, an object)
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
