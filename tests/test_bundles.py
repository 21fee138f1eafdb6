"""Bundles: a round trip between two caches compiles nothing and checks every digest; hostile
archives are refused whole, with nothing written outside the cache (or inside it)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import client  # noqa: F401 - the client's torch ops, registered on import
from compile_service import provenance
from compile_service.bundle import BundleError, Policy, import_, import_layer, info, runs_on, shared_toolchain, verify
from compile_service.keys import tilelang_version
from compile_service.store import LocalStore
from devtools.launch import DaemonProcess
from kernels import reference
from tests.marks import needs_nvrtc
from tests.plant import abi, host_toolchain, key_of, spec_of

ROOT = Path(__file__).resolve().parent.parent
CC = "nvrtc-13.0"
OPEN = Policy(trust_unsigned=True, any_arch=True)  # archive checks come after provenance and arch: open both


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


# ----- real entries, two caches


def test_round_trip_between_two_caches_compiles_nothing(make_daemon, tmp_path):
    specs = [
        {"kind": "gemm", "target": "c", "M": None, "N": 40, "K": 24, "dtype": "float32"},
        {"kind": "rmsnorm", "target": "c", "M": None, "N": 64, "dtype": "float32"},
        {"kind": "softmax", "target": "c", "M": 5, "N": 48, "dtype": "float32"},
    ]
    builder = make_daemon()
    assert builder.client(app="svc").prefetch(specs, load=False) == ["compiled"] * 3
    assert cli("manifest", "--app", "svc", "--cache-dir", str(builder.cache_dir), "-o", str(tmp_path / "svc.json")).returncode == 0
    exported = cli("bundle", "export", "--manifest", str(tmp_path / "svc.json"), "--cache-dir", str(builder.cache_dir), "-o", str(tmp_path / "svc.tar.gz"))
    assert exported.returncode == 0, exported.stderr
    assert "3 entries, 9 files" in exported.stdout and "signed by ed25519:" in exported.stdout  # entry.json, kernel.so, kernel.c each
    with tarfile.open(tmp_path / "svc.tar.gz") as tar:
        names = tar.getnames()
    assert names[:2] == ["bundle.json", "bundle.sig"] and len(names) == 11 and all(n.startswith("blobs/") for n in names[2:])
    key = cli("bundle", "key", "--cache-dir", str(builder.cache_dir))
    assert key.returncode == 0 and key.stdout.startswith("-----BEGIN PUBLIC KEY-----"), key.stderr
    assert stat.S_IMODE(os.stat(builder.cache_dir / provenance.SIGNING_KEY).st_mode) == 0o600
    (tmp_path / "builder.pub").write_text(key.stdout)

    other = tmp_path / "other-cache"
    trusted = ("--trusted-key", str(tmp_path / "builder.pub"))
    imported = cli("bundle", "import", str(tmp_path / "svc.tar.gz"), "--cache-dir", str(other), *trusted)
    assert imported.returncode == 0, imported.stderr
    assert "imported 3 entries" in imported.stdout and "(0 already there; 9 files' sha256 checked" in imported.stdout
    assert "a trusted key" in imported.stdout
    again = cli("bundle", "import", str(tmp_path / "svc.tar.gz"), "--cache-dir", str(other), env={**os.environ, provenance.TRUSTED_KEYS_ENV: trusted[1]})
    assert "imported 0 entries" in again.stdout and "3 already there" in again.stdout
    assert cli("verify", "--cache-dir", str(other)).returncode == 0
    assert sorted(p.name for p in other.iterdir()) == ["blobs", "entries", "staging"] and not list((other / "staging").iterdir())

    serving = make_daemon("--no-compile", cache_dir=other)
    c = serving.client(strict=True, direct_hits=False)  # served by the daemon, not straight from the disk
    for s in specs:
        params = {k: v for k, v in s.items() if k not in ("kind", "target")}
        k = c.get_kernel(s["kind"], target="c", **params)
        assert k.outcome == "hit"
        x = reference.make_inputs(s["kind"], k.spec["params"])
        assert (k(*x) - reference.reference(s["kind"], k.spec["params"], x)).abs().max() < 1e-4
    assert c.stats()["compiles"] == 0 and c.stats()["hits"] == 3


def test_export_names_what_the_cache_lacks(make_daemon, tmp_path):
    d = make_daemon(start=False)
    LocalStore(d.cache_dir)
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "format": "kernel-service-manifest",
                "version": 1,
                "kernels": [{"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": 8, "dtype": "float32"}}],
            }
        )
    )
    out = cli("bundle", "export", "--manifest", str(path), "--cache-dir", str(d.cache_dir), "-o", str(tmp_path / "b.tar"))
    assert out.returncode == 1 and "1 of the manifest's 1 kernels are not in the cache" in out.stderr and "kernel-service prewarm" in out.stderr
    assert not (tmp_path / "b.tar").exists() and not list(tmp_path.glob(".b.tar*"))


@needs_nvrtc
def test_sm90a_bundle_serves_on_a_host_with_no_cuda_compiler(make_daemon, tmp_path):
    """Built here (no GPU: cross-compiled), exported for that one arch, imported and served where
    no nvcc is on PATH and NVRTC is never used: keys name the builder's compiler through
    --cuda-compiler-id, and --target says the host serves sm_90a though no GPU shows here."""
    spec = {"kind": "rmsnorm", "target": "sm_90a", "M": None, "N": 256, "dtype": "float16"}
    builder = make_daemon("--cuda-compiler", "nvrtc")
    assert builder.client(app="gpu").prefetch([spec, {**spec, "target": "c", "dtype": "float32"}], load=False) == ["compiled"] * 2
    builder_cc = builder.client().stats()["cuda_compiler"]
    cli("manifest", "--app", "gpu", "--cache-dir", str(builder.cache_dir), "-o", str(tmp_path / "gpu.json"))
    exporting = ("bundle", "export", "--manifest", str(tmp_path / "gpu.json"), "--cache-dir", str(builder.cache_dir), "--cuda-compiler", "nvrtc")
    exported = cli(*exporting, "--target", "sm_90a", "-o", str(tmp_path / "gpu.tar"))
    assert exported.returncode == 0 and "1 entries" in exported.stdout, exported.stderr
    assert cli(*exporting, "--target", "c", "-o", str(tmp_path / "cpu.tar.xz")).returncode == 0
    assert [e["target"] for e in info(tmp_path / "gpu.tar")["entries"]] == ["sm_90a"]
    assert [e["target"] for e in info(tmp_path / "cpu.tar.xz")["entries"]] == ["c"]
    (tmp_path / "builder.pub").write_text(cli("bundle", "key", "--cache-dir", str(builder.cache_dir)).stdout)

    bare = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")} | {"PATH": "/usr/bin:/bin"}
    assert shutil.which("nvcc", path=bare["PATH"]) is None
    importing = ("bundle", "import", str(tmp_path / "gpu.tar"), "--cache-dir", str(tmp_path / "gpu-cache"), "--trusted-key", str(tmp_path / "builder.pub"))
    refused = cli(*importing, "--target", "sm_90a", "--cuda-compiler", "nvcc", env=bare)
    assert refused.returncode == 1
    assert f"cuda {builder_cc} (bundle) vs nvcc-none (this host)" in refused.stderr and f"--cuda-compiler-id {builder_cc}" in refused.stderr
    no_gpu = cli(*importing, "--target", "c", "--cuda-compiler-id", builder_cc, env=bare)
    assert no_gpu.returncode == 1 and "holds kernels for sm_90a, which this host cannot run" in no_gpu.stderr and "--any-arch" in no_gpu.stderr
    imported = cli(*importing, "--target", "sm_90a", "--cuda-compiler-id", builder_cc, env=bare)
    assert imported.returncode == 0 and "imported 1 entries" in imported.stdout, imported.stderr

    args = ("--target", "c", "--no-compile", "--cuda-compiler-id", builder_cc)
    with DaemonProcess(tmp_path / "gpu-cache", *args, env={"PATH": bare["PATH"], "CUDA_HOME": "", "CUDA_PATH": ""}, log_path=tmp_path / "gpu.log") as gpu:
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{gpu.proc.pid}/environ").read_text().split("\0") if "=" in v)
        assert shutil.which("nvcc", path=environ["PATH"]) is None and not environ["CUDA_HOME"]
        k = gpu.client(strict=True).get_kernel("rmsnorm", target="sm_90a", M=None, N=256, dtype="float16")
        assert k.outcome == "hit" and k.abi["loader"] == "tvm_ffi"  # loaded (running it needs a GPU)
        stats = gpu.client().stats()
        assert (stats["compiles"], stats["workers"], stats["cuda_compiler"]) == (0, 0, builder_cc)


# ----- synthetic bundles: every member and field under the test's control


def entry(kind: str, target: str, params: dict, toolchain_changes: dict | None = None, cc: str = CC) -> dict:
    spec = spec_of(kind, target, **params)
    toolchain = {**host_toolchain(spec, cc), **(toolchain_changes or {})}
    meta = {"spec": spec, "abi": abi(target), "toolchain": toolchain, "compile_seconds": 0.1, "created": 0.0}
    files = {"entry.json": json.dumps(meta).encode(), "kernel.so": hashlib.sha256(json.dumps(spec).encode()).digest() * 64, "kernel.c": b"/* source */"}
    return {"key": key_of(spec, toolchain), "spec": spec, "files": files}


def members(entries: list[dict], index_changes: dict | None = None, cc: str = CC) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    blobs, index_entries = {}, []
    for e in entries:
        files = {}
        for name, data in e["files"].items():
            sha = hashlib.sha256(data).hexdigest()
            blobs[sha] = data
            files[name] = {"size": len(data), "sha256": sha}
        index_entries.append({"key": e["key"], "spec": e["spec"], "library": "kernel.so", "files": files})
    index = {"format": "kernel-service-bundle", "version": 1, "toolchain": shared_toolchain(cc), "entries": index_entries, **(index_changes or {})}
    return [file("bundle.json", json.dumps(index).encode())] + [file(f"blobs/{sha}", data) for sha, data in blobs.items()]


def file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, type_: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = type_, linkname
    return info, None


def write(path: Path, items, mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for info, data in items:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


GOOD = [("rmsnorm", "c", {"M": None, "N": 64, "dtype": "float32"}), ("softmax", "c", {"M": None, "N": 32, "dtype": "float32"})]


@pytest.fixture
def place(tmp_path):
    """A cache, a directory beside it that hostile members aim at, and a check that neither
    holds anything new afterwards."""
    store = LocalStore(tmp_path / "cache")
    outside = tmp_path / "outside"
    outside.mkdir()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    yield store, outside
    after = sorted(str(p) for p in tmp_path.rglob("*") if not p.name.endswith((".tar", ".tgz")))
    assert after == [p for p in before if not p.endswith((".tar", ".tgz"))], "the import left files behind"
    assert not list(outside.iterdir()) and store.keys() == [] and not list(store.staging_dir.iterdir())


def good() -> list:
    return members([entry(*e) for e in GOOD])


def blob_name(items) -> str:
    return next(info.name for info, _ in items if info.name.startswith("blobs/"))


def _index(changes_to_entry0: dict) -> list:
    e = entry(*GOOD[0])
    items = members([e])
    index = json.loads(items[0][1])
    index["entries"][0].update(changes_to_entry0(index["entries"][0]) if callable(changes_to_entry0) else changes_to_entry0)
    return [file("bundle.json", json.dumps(index).encode()), *items[1:]]


def _bomb() -> bytes:
    """A pax header of 80 MB of one repeated byte: a few hundred KB once compressed."""
    info = tarfile.TarInfo("blobs/" + "0" * 64)
    info.pax_headers = {"comment": "x" * (80 << 20)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b""))
    return gzip.compress(buf.getvalue(), compresslevel=1)


def _huge_header() -> bytes:
    """One member whose header claims 1 TiB, and no data behind it."""
    info = tarfile.TarInfo("blobs/" + "1" * 64)
    info.size = 1 << 40
    return info.tobuf(format=tarfile.GNU_FORMAT) + bytes(1024)


HOSTILE = {
    "path traversal": (lambda o: good() + [file("../outside/evil", b"pwned")], "path traversal"),
    "traversal inside blobs": (lambda o: good() + [file("blobs/../../outside/evil", b"pwned")], "path traversal"),
    "absolute path": (lambda o: good() + [file(str(o / "evil"), b"pwned")], "is an absolute path"),
    "symbolic link": (lambda o: [special("blobs/" + "a" * 64, tarfile.SYMTYPE, str(o))] + good(), "is a symbolic link"),
    "hard link": (lambda o: good() + [special("blobs/" + "b" * 64, tarfile.LNKTYPE, "bundle.json")], "is a hard link"),
    "character device": (lambda o: good() + [special("blobs/" + "c" * 64, tarfile.CHRTYPE)], "is a character device"),
    "block device": (lambda o: good() + [special("blobs/" + "d" * 64, tarfile.BLKTYPE)], "is a block device"),
    "fifo": (lambda o: good() + [special("blobs/" + "e" * 64, tarfile.FIFOTYPE)], "is a fifo"),
    "directory": (lambda o: [special("blobs", tarfile.DIRTYPE)] + good(), "is a directory"),
    "unknown member": (lambda o: good() + [file("install.sh", b"#!/bin/sh\n")], "is not a bundle file"),
    "digest mismatch": (
        lambda o: [(info, data if not info.name.startswith("blobs/") else b"X" + data[1:]) for info, data in good()],
        "does not match its sha256",
    ),
    "member twice": (lambda o: good() + good()[:1], "appears twice"),
    "entry file name leaving the entry": (
        lambda o: _index(lambda e: {"files": {**e["files"], "../../outside/evil": e["files"]["kernel.c"]}}),
        "is not a plain file name",
    ),
    "tampered key": (lambda o: _index({"key": "f" * 64}), "its key is not the one this host computes"),
    "index and entry disagree": (lambda o: _index(lambda e: {"spec": {**e["spec"], "target": "sm_90a"}}), "record different specs"),
    "blob of no entry": (lambda o: good() + [file("blobs/" + hashlib.sha256(b"extra").hexdigest(), b"extra")], "belongs to no entry"),
    "no index": (lambda o: good()[1:], "no bundle.json"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_archives_are_refused_whole(place, tmp_path, case):
    store, outside = place
    build, expected = HOSTILE[case]
    bundle = write(tmp_path / "hostile.tar", build(outside))
    with pytest.raises(BundleError, match=expected):
        import_(store, bundle, CC, OPEN)


@pytest.mark.parametrize(
    "case, data, limits, expected",
    [
        ("header claiming 1 TiB", _huge_header, {}, "has 1099511627776 bytes, at most 268435456 are accepted"),
        ("member over the bound", lambda: None, {"max_member": 1024}, "at most 1024 are accepted"),
        ("files over the total", lambda: None, {"max_total": 4096}, "more than 4096 bytes of files in all"),
        ("decompression bomb", _bomb, {"max_total": 1 << 20}, "oversized"),
        ("not an archive", lambda: os.urandom(4096), {}, "not a readable bundle"),
    ],
)
def test_oversized_and_garbled_archives_are_refused(place, tmp_path, case, data, limits, expected):
    store, _ = place
    raw = data()
    bundle = tmp_path / "hostile.tgz"
    if raw is None:
        write(bundle, good(), "w:gz")
    else:
        bundle.write_bytes(raw)
    with pytest.raises(BundleError, match=expected):
        import_(store, bundle, CC, OPEN, **limits)


def test_the_command_refuses_a_hostile_bundle_in_one_line(place, tmp_path):
    store, outside = place
    bundle = write(tmp_path / "hostile.tar", good() + [file("../outside/evil", b"pwned")])
    out = cli("bundle", "import", str(bundle), "--cache-dir", str(store.root), "--cuda-compiler-id", CC, "--trust-unsigned")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"kernel-service: {bundle}: member '../outside/evil' leads out of the bundle (path traversal)")


def test_a_foreign_toolchain_is_refused_naming_the_field(place, tmp_path):
    store, _ = place
    old = entry(*GOOD[0], toolchain_changes={"tilelang": "0.1.14"})
    bundle = write(tmp_path / "old.tar", members([old], {"toolchain": {**shared_toolchain(CC), "tilelang": "0.1.14"}}))
    with pytest.raises(
        BundleError, match=rf"built with another toolchain: tilelang 0.1.14 \(bundle\) vs {tilelang_version()} \(this host\); its keys would never"
    ):
        import_(store, bundle, CC, OPEN)

    edited = entry(*GOOD[0], toolchain_changes={"kind_source": "0" * 16})  # the kind's source differs
    bundle = write(tmp_path / "edited.tar", members([edited]))
    with pytest.raises(BundleError, match=r"entries\[0\] \(rmsnorm\): built with another toolchain: kind_source 0000000000000000 \(bundle\)"):
        import_(store, bundle, CC, OPEN)


def test_a_cuda_bundle_names_the_builders_compiler(tmp_path):
    store = LocalStore(tmp_path / "cache")
    cuda = entry("rmsnorm", "sm_90a", {"M": None, "N": 256, "dtype": "float16"}, cc="nvcc-13.0.88")
    bundle = write(tmp_path / "cuda.tar", members([cuda, entry(*GOOD[0], cc="nvcc-13.0.88")], cc="nvcc-13.0.88"))
    with pytest.raises(BundleError, match=r"cuda nvcc-13.0.88 \(bundle\) vs nvrtc-13.0 \(this host\); .*--cuda-compiler-id nvcc-13.0.88"):
        import_(store, bundle, CC, OPEN)
    assert store.keys() == []
    report = import_(store, bundle, "nvcc-13.0.88", OPEN)  # a serve-only host keys as the builder did
    assert (report.imported, report.present, report.digests_checked) == (2, 0, 5)  # one kernel.c shared by both
    assert store.lookup(cuda["key"], cuda["spec"]).meta["toolchain"]["cuda_compiler"] == "nvcc-13.0.88"
    assert import_(store, bundle, "nvcc-13.0.88", OPEN).present == 2
    # A CPU-only bundle does not depend on the CUDA compiler at all.
    assert import_(store, write(tmp_path / "cpu.tar", members([entry(*GOOD[1])])), "nvcc-none", OPEN).imported == 1


def test_an_import_cut_short_leaves_a_staging_dir_the_next_start_sweeps(tmp_path):
    store = LocalStore(tmp_path / "cache")
    work = store.new_staging("import")  # what import_ works in, named by its pid
    dead = work.with_name(work.name.replace(f"{os.getpid()}.", "999999999.", 1))  # its writer gone
    work.rename(dead)
    assert store.clean_staging() == 1 and not dead.exists()


# ----- provenance: who signed it (who wrote the file: tests/test_security.py, as a second user)


def new_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def signed(items: list, key) -> list:
    """`items` with bundle.sig, the signature of its bundle.json by `key`, right after it."""
    return [items[0], file("bundle.sig", provenance.sign(key, items[0][1])), *items[1:]]


def resealed(items: list, library: bytes) -> list:
    """The attack: every kernel.so swapped for `library`, bundle.json's digests re-sealed around
    it (keys do not depend on the library's bytes), any bundle.sig kept as it was."""
    index = json.loads(items[0][1])
    sha = hashlib.sha256(library).hexdigest()
    old = set()
    for e in index["entries"]:
        old.add(e["files"]["kernel.so"]["sha256"])
        e["files"]["kernel.so"] = {"size": len(library), "sha256": sha}
    kept = [(info, data) for info, data in items[1:] if info.name.removeprefix("blobs/") not in old]
    return [file("bundle.json", json.dumps(index).encode()), *kept, file(f"blobs/{sha}", library)]


def test_a_signed_bundle_imports_only_with_its_signer_trusted(tmp_path):
    key, other = new_key(), new_key()
    bundle = write(tmp_path / "signed.tar", signed(good(), key))
    store = LocalStore(tmp_path / "cache")
    with pytest.raises(BundleError, match=rf"signed by {provenance.key_id(key.public_key())}, which is not a trusted key \(no trusted key was given\)"):
        import_(store, bundle, CC)
    with pytest.raises(BundleError, match=r"not a trusted key \(the 1 trusted keys given\)"):
        import_(store, bundle, CC, Policy(trusted_keys=(other.public_key(),)))
    with pytest.raises(BundleError, match=r"not signed, and unsigned bundles are not trusted: .*--trust-unsigned"):
        import_(store, write(tmp_path / "unsigned.tar", good()), CC, Policy(trusted_keys=(key.public_key(),)))
    assert store.keys() == [] and not list(store.staging_dir.iterdir())
    report = import_(store, bundle, CC, Policy(trusted_keys=(other.public_key(), key.public_key())))
    assert report.imported == 2 and report.provenance == f"signed by {provenance.key_id(key.public_key())}, a trusted key"


def test_a_manifest_resealed_around_another_library_is_refused(tmp_path):
    key = new_key()
    trusted = Policy(trusted_keys=(key.public_key(),), any_arch=True)
    evil = b"\x7fELF not the builder's library"
    attacks = {
        "signature kept": (resealed(signed(good(), key), evil), "bundle.sig does not match bundle.json .*changed after it was signed"),
        "re-signed by the attacker": (signed(resealed(good(), evil), new_key()), "which is not a trusted key"),
        "signature stripped": (resealed(good(), evil), "not signed"),
        "signature moved after the files": ([*resealed(good(), evil), file("bundle.sig", provenance.sign(key, good()[0][1]))], "not signed"),
        "signature record garbled": ([good()[0], file("bundle.sig", b"[" * 5000), *good()[1:]], "not a signature this host reads"),
    }
    for name, (items, expected) in attacks.items():
        store = LocalStore(tmp_path / name / "cache")
        with pytest.raises(BundleError, match=expected):
            import_(store, write(tmp_path / name / "b.tar", items), CC, trusted)
        assert store.keys() == [] and not list(store.blobs.dir.rglob("*")), name  # nothing stored, not even a blob
    # What the signature stops: without it the re-sealed library would be published under the real key.
    store = LocalStore(tmp_path / "unchecked")
    assert import_(store, write(tmp_path / "stripped.tar", resealed(good(), evil)), CC, OPEN).imported == 2
    assert all((store.lookup(k).path / "kernel.so").read_bytes() == evil for k in store.keys())


def _with_meta(change) -> list:
    """good()'s first entry with its entry.json changed by `change(meta)`, every digest re-sealed."""
    e = entry(*GOOD[0])
    meta = json.loads(e["files"]["entry.json"])
    change(meta)
    e["files"]["entry.json"] = json.dumps(meta).encode()
    return members([e])


def _with_index(change) -> list:
    items = good()
    index = json.loads(items[0][1])
    change(index)
    return [file("bundle.json", json.dumps(index).encode()), *items[1:]]


ILL_TYPED = {
    "nested bundle.json": (lambda: [file("bundle.json", b"[" * 100_000 + b"]" * 100_000), *good()[1:]], "nested more than 32 levels deep"),
    "nested entry": (
        lambda: _with_index(lambda i: i["entries"][0].update(spec={"kind": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})),
        "nested more than",
    ),
    "params a list": (lambda: _with_meta(lambda m: m["spec"].update(params=[1, 2])), "its spec's params are not an object"),
    "toolchain a list": (lambda: _with_meta(lambda m: m.update(toolchain=[1])), "built with another toolchain"),
}


@pytest.mark.parametrize("case", ILL_TYPED)
def test_nested_or_ill_typed_metadata_is_a_bundle_error(place, tmp_path, case):
    store, _ = place
    build, expected = ILL_TYPED[case]
    bundle = write(tmp_path / "ill.tar", build())
    with pytest.raises(BundleError, match=expected):
        import_(store, bundle, CC, OPEN)
    if case.startswith("nested"):
        with pytest.raises(BundleError, match=expected):
            info(bundle)


# ----- arches


def test_what_a_host_runs():
    from kernels import parse_target

    def runs(arch: str, host: str) -> bool:
        return runs_on(arch, parse_target(host))

    assert runs("c", "c") and runs("c", "sm_90a")
    assert not runs("sm_90a", "c") and not runs("sm_80", "c")
    assert runs("sm_90a", "sm_90a") and runs("sm_90", "sm_90a")  # a Hopper host is named sm_90a
    assert runs("sm_80", "sm_86") and not runs("sm_86", "sm_80")  # a newer minor runs an older one's binary
    assert not runs("sm_90a", "sm_100a") and not runs("sm_80", "sm_90a")  # not across a major version
    assert runs("sm_100a", "sm_100") and not runs("sm_100a", "sm_103")  # arch-specific: that one compute capability


def test_import_refuses_an_arch_the_host_cannot_run(tmp_path):
    items = members([entry("rmsnorm", "sm_90a", {"M": None, "N": 256, "dtype": "float16"}), entry(*GOOD[0])])
    bundle = write(tmp_path / "gpu.tar", items)
    store = LocalStore(tmp_path / "cache")
    for host in ("c", "sm_80"):
        with pytest.raises(BundleError, match=r"holds kernels for sm_90a, which this host cannot run .*pass --target sm_90a or --any-arch"):
            import_(store, bundle, CC, Policy(trust_unsigned=True, host_target=host))
    assert store.keys() == []
    assert import_(store, bundle, CC, Policy(trust_unsigned=True, host_target="sm_90a")).arches == {"sm_90a": 1, "c": 1}
    assert import_(store, bundle, CC, Policy(trust_unsigned=True, host_target="c", any_arch=True)).present == 2


# ----- formats, info, verify, layers


def test_xz_gzip_and_todays_bundles_all_import(tmp_path):
    key = new_key()
    policy = Policy(trusted_keys=(key.public_key(),))
    for mode, compression in (("w:xz", "xz"), ("w:gz", "gzip"), ("w", "none")):
        bundle = write(tmp_path / f"b-{compression}", signed(good(), key), mode)  # the name says nothing: import reads the bytes
        assert info(bundle)["compression"] == compression
        assert import_(LocalStore(tmp_path / compression), bundle, CC, policy).imported == 2
    today = write(tmp_path / "today.tar.gz", good(), "w:gz")  # version 1, unsigned, as export wrote it before
    assert json.loads(good()[0][1])["version"] == 1
    assert import_(LocalStore(tmp_path / "today"), today, CC, Policy(trust_unsigned=True)).imported == 2


def test_info_lists_the_contents_by_kind_and_arch_and_verify_publishes_nothing(tmp_path):
    key = new_key()
    (tmp_path / "key.pub").write_text(provenance.public_pem(key))
    items = signed(members([entry(*GOOD[0]), entry(*GOOD[1]), entry("rmsnorm", "sm_90a", {"M": None, "N": 256, "dtype": "float16"})]), key)
    bundle = write(tmp_path / "b.tar.xz", items, "w:xz")
    about = info(bundle)
    assert about["signed_by"] == provenance.key_id(key.public_key()) and about["compression"] == "xz" and len(about["entries"]) == 3
    assert about["files"] == 7  # kernel.c shared by all three
    assert {k: v["entries"] for k, v in about["by_kind"].items()} == {"rmsnorm": 2, "softmax": 1}
    assert {k: v["entries"] for k, v in about["by_arch"].items()} == {"c": 2, "sm_90a": 1}
    shown = cli("bundle", "info", str(bundle))
    assert shown.returncode == 0 and "xz compression" in shown.stdout and "arch  sm_90a" in shown.stdout and "kind  softmax" in shown.stdout, shown.stderr

    report = verify(bundle, CC, Policy(trusted_keys=(key.public_key(),), host_target="sm_90a"))
    assert (report.entries, report.digests_checked, report.arches) == (3, 7, {"c": 2, "sm_90a": 1})
    args = ("bundle", "verify", str(bundle), "--cuda-compiler-id", CC, "--trusted-key", str(tmp_path / "key.pub"))
    good_run = cli(*args, "--target", "sm_90a")
    assert good_run.returncode == 0 and "would import: 3 entries (c 2, sm_90a 1)" in good_run.stdout and "a trusted key" in good_run.stdout
    assert "cannot run" in cli(*args, "--target", "c").stderr
    tampered = write(tmp_path / "t.tar", resealed(items, b"evil"))
    bad_run = cli("bundle", "verify", str(tampered), "--cuda-compiler-id", CC, "--trusted-key", str(tmp_path / "key.pub"), "--any-arch")
    assert bad_run.returncode == 1 and "does not match bundle.json" in bad_run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.xz", "key.pub", "t.tar"]  # verify wrote nothing here


def test_import_as_a_layer_lays_a_read_only_cache_root(tmp_path):
    key = new_key()
    policy = Policy(trusted_keys=(key.public_key(),))
    bundle = write(tmp_path / "b.tar", signed(good(), key))
    layer = tmp_path / "layer"
    assert import_layer(layer, bundle, CC, policy).imported == 2
    assert sorted(p.name for p in layer.iterdir()) == ["blobs", "entries", "staging"]
    modes = {stat.S_IMODE(os.lstat(p).st_mode) for p in [layer, *layer.rglob("*")] if p.is_dir()}
    assert modes == {0o555} and {stat.S_IMODE(os.lstat(p).st_mode) for p in layer.rglob("*") if not p.is_dir()} == {0o444}
    served = LocalStore(layer, create=False)  # a cache root as LocalStore writes it
    assert all(served.lookup(e["key"], e["spec"]) is not None for e in json.loads(good()[0][1])["entries"])

    with pytest.raises(BundleError, match="exists and is not an empty directory"):
        import_layer(layer, bundle, CC, policy)
    with pytest.raises(BundleError, match="not a trusted key"):
        import_layer(tmp_path / "refused", bundle, CC)
    assert not (tmp_path / "refused").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "key.pub").write_text(provenance.public_pem(key))
    made = cli("bundle", "import", str(bundle), "--layer", str(tmp_path / "empty"), "--cuda-compiler-id", CC, "--trusted-key", str(tmp_path / "key.pub"))
    assert made.returncode == 0 and "into a read-only layer at" in made.stdout, made.stderr


def test_a_signing_key_others_may_read_is_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization

    path = tmp_path / "signing.pem"
    path.write_bytes(new_key().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(path, 0o644)
    with pytest.raises(provenance.ProvenanceError, match="that no one else may read or write .*mode 0644"):
        provenance.load_signing_key(path)
    os.chmod(path, 0o600)
    assert provenance.load_signing_key(path) is not None
