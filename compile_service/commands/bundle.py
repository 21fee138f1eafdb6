"""`kernel-service bundle export|import|verify|info|key`: cache entries packed for another host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .cache import cache_dir_of
from .output import fail, human_bytes, os_error
from .specs import load_manifests, params_of


def _keying_compiler(args) -> str:
    """The device compiler id CUDA keys are made with: --cuda-compiler-id (else its variable: a
    host that does not compile, serving a builder's entries), else the compiler --cuda-compiler picks here."""
    from ..build import devices
    from ..config import resolve_setting

    named = resolve_setting("cuda_compiler_id", args.cuda_compiler_id)[0]
    return devices.named(named).id if named else devices.choose(args.cuda_compiler).id


def _load_kinds(args) -> None:
    """The kinds whose keys the bundle's entries carry: the zoo, the installed ones, --kernel-module's."""
    from kernels import plugins

    plugins.load(tuple(args.kernel_modules or ()), entry_points=True)


def export(args) -> int:
    import kernels

    from .. import provenance
    from ..bundle import BundleError, export
    from ..store import LocalStore

    cache_dir = cache_dir_of(args)
    try:
        compiler = _keying_compiler(args)
        _load_kinds(args)
        specs = load_manifests([args.manifest])
        if args.target is not None:
            kernels.parse_target(args.target)
    except ValueError as exc:  # a bad --cuda-compiler(-id) or --target, or no manifest (ManifestError)
        return fail(str(exc), 2)
    try:
        canonical = [kernels.canonicalize(s["kind"], params_of(s), s["target"]) for s in specs]
    except ValueError as exc:  # InvalidSpec: "<field>: <message>"
        return fail(f"{args.manifest}: {exc}", 2)
    try:
        store = LocalStore(cache_dir, create=False)
        key = None
        if not args.no_sign:
            key = provenance.load_signing_key(args.signing_key) if args.signing_key else provenance.cache_signing_key(cache_dir)
        summary = export(store, canonical, compiler, Path(args.output), key, args.target)
    except (BundleError, provenance.ProvenanceError) as exc:
        return fail(str(exc))
    except OSError as exc:  # no cache there
        return fail(os_error(exc))
    signed = f"signed by {summary['signed_by']}" if summary["signed_by"] else "unsigned"
    print(f"wrote {args.output}: {summary['entries']} entries, {summary['blobs']} files, {human_bytes(summary['bytes'])}, {signed}")
    return 0


def _policy(args):
    """What import and verify accept, from --trusted-key (else $KERNEL_SERVICE_TRUSTED_KEYS),
    --trust-unsigned, --target and --any-arch; raises ProvenanceError, or ValueError for --target."""
    import kernels

    from .. import provenance
    from ..bundle import Policy

    if args.target is not None:
        kernels.parse_target(args.target)
    keys = provenance.load_trusted_keys(provenance.trusted_key_paths(args.trusted_key))
    return Policy(trusted_keys=keys, trust_unsigned=args.trust_unsigned, host_target=args.target, any_arch=args.any_arch)


def import_(args) -> int:
    from .. import provenance
    from ..bundle import BundleError, import_, import_layer
    from ..store import LocalStore, existing_mode

    cache_dir = cache_dir_of(args)
    try:
        _load_kinds(args)
        compiler = _keying_compiler(args)
        policy = _policy(args)
        if args.layer:
            where = Path(args.layer)
            report = import_layer(where, Path(args.bundle), compiler, policy)
        else:
            where = cache_dir
            report = import_(LocalStore(cache_dir, existing_mode(cache_dir)), Path(args.bundle), compiler, policy)
    except (BundleError, provenance.ProvenanceError) as exc:
        return fail(str(exc))
    except ValueError as exc:
        return fail(str(exc), 2)
    except OSError as exc:  # the cache refused a write (StoreError), or cannot be created
        return fail(os_error(exc))
    what = "a read-only layer at" if args.layer else "the cache"
    print(
        f"imported {report.imported} entries into {what} {where} ({report.present} already there; {report.digests_checked} files' sha256 checked, "
        f"{human_bytes(report.bytes)}; {report.provenance})"
    )
    return 0


def verify(args) -> int:
    from .. import provenance
    from ..bundle import BundleError, verify

    try:
        _load_kinds(args)
        compiler = _keying_compiler(args)
        report = verify(Path(args.bundle), compiler, _policy(args))
    except (BundleError, provenance.ProvenanceError) as exc:
        return fail(str(exc))
    except ValueError as exc:
        return fail(str(exc), 2)
    arches = ", ".join(f"{arch} {n}" for arch, n in sorted(report.arches.items()))
    print(
        f"{args.bundle}: would import: {report.entries} entries ({arches}), {report.digests_checked} files' sha256 checked, "
        f"{human_bytes(report.bytes)}; toolchain and keys match this host; {report.provenance}"
    )
    return 0


def info(args) -> int:
    from ..bundle import BundleError, info

    try:
        about = info(Path(args.bundle))
    except BundleError as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(about, indent=1))
        return 0
    signed = about["signed_by"] or "unsigned"
    print(
        f"{about['path']}: bundle version {about['version']}, {about['compression']} compression, {human_bytes(about['bytes'])}, "
        f"{len(about['entries'])} entries, {about['files']} files ({human_bytes(about['file_bytes'])} unpacked), "
        f"{signed} (not checked against trusted keys: `bundle verify` does)"
    )
    print("toolchain  " + " ".join(f"{k}={v}" for k, v in sorted(about["toolchain"].items())))
    for title, group in (("kind", "by_kind"), ("arch", "by_arch")):
        for name, t in about[group].items():
            print(f"{title:<5} {name:<16} {t['entries']:>5} entries  {human_bytes(t['bytes']):>10}")  # shared files in each entry
    for row in about["entries"]:
        params = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(row["params"].items()))
        print(f"  {row['kind']:<10} {row['target']:<7} {human_bytes(row['bytes']):>10}  {params}")
    return 0


def key(args) -> int:
    from .. import provenance
    from ..store import LocalStore

    try:
        if args.signing_key:
            key = provenance.load_signing_key(args.signing_key)
        else:
            cache_dir = cache_dir_of(args)
            LocalStore(cache_dir, create=False)  # the cache's owner, on a cache that exists: its root is trusted
            key = provenance.cache_signing_key(cache_dir)
    except provenance.ProvenanceError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(os_error(exc))
    print(provenance.public_pem(key), end="")
    print(f"# {provenance.key_id(key.public_key())}: pass this file to `bundle import --trusted-key`", file=sys.stderr)
    return 0
