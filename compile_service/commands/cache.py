"""The commands on the cache and its kernels: ls, prune, clear, verify (on disk: safe while a
daemon serves the cache), kinds, manifest, explain."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .asking import NoDaemon, ask
from .output import ago, fail, human_bytes
from .specs import label, show


def cache_dir_of(args) -> Path:
    """--cache-dir, else $KERNEL_SERVICE_CACHE_DIR, else the default: as serve resolves it."""
    from ..config import resolve_setting

    return resolve_setting("cache_dir", args.cache_dir)[0]


def open_store(args, changes: str | None = None):
    """The cache at --cache-dir (default: the daemon's default), for the commands that work on disk;
    `changes`: the command, when it may remove things (never from a read-only layer)."""
    from ..layout import counted_dirs
    from ..store import LocalStore
    from ..store.layers import is_layer

    cache_dir = cache_dir_of(args)
    if changes and is_layer(cache_dir):
        raise SystemExit(fail(f"{cache_dir} is a read-only cache layer (its owner may not write it): `kernel-service {changes}` never changes one", 2))
    try:
        return LocalStore(cache_dir, create=False, extra_usage=counted_dirs(cache_dir))
    except OSError as exc:
        raise SystemExit(fail(f"{exc.strerror or exc}; pass --cache-dir the cache root a daemon uses (see `kernel-service info`)", 2)) from None


def verify(args) -> int:
    from ..store.check import verify

    store = open_store(args, changes="verify --repair" if args.repair else None)
    cache_dir = store.root
    report = verify(store, repair=args.repair)
    if args.json:
        damage = [{"what": d.what, "path": str(d.path), "why": d.why, "repaired": d.repaired} for d in report.damage]
        print(json.dumps({"cache_dir": str(cache_dir), "entries_ok": report.entries_ok, "staging_in_use": report.staging_in_use, "damage": damage}, indent=2))
    else:
        for d in report.damage:
            print(f"{'removed' if d.repaired else 'DAMAGED'} {d.what:>7}: {d.path}: {d.why}")
        print(
            f"{cache_dir}: {report.entries_ok} entries ok, {len(report.damage)} damaged, {len(report.unrepaired)} left unrepaired, {report.staging_in_use} staging dirs in use"
        )
        if report.unrepaired and not args.repair:
            print("run `kernel-service verify --repair` to remove them (safe while the daemon runs)")
    return 1 if report.unrepaired else 0


def ls(args) -> int:
    from ..store.listing import list_entries

    store = open_store(args)
    entries = list_entries(store)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        params = ",".join(f"{k}={v}" for k, v in e["params"].items() if not k.startswith(("block_", "num_", "threads")))  # M=None shown: a runtime size
        built = f"copy of {e['shared_build'][:12]}" if e["built"] == "copy" else f"compiled in {e['compile_seconds']:.2f}s"
        compiler = f" {e['cuda_compiler']}" if e["cuda_compiler"] and e["target"] != "c" else ""
        print(f"{e['key'][:12]}  {e['kind']:<9} {e['target']:<7} {human_bytes(e['bytes']):>9}  used {ago(e['last_used']):<11} {built}{compiler}  {params}")
    entries_count, total = store.usage()
    print(f"{store.root}: {entries_count} entries, {human_bytes(total)} in all (blobs and device binaries included)")
    return 0


def prune(args) -> int:
    from ..store import Budget

    max_bytes = args.max_bytes
    store = open_store(args, changes="prune")
    before = store.usage()
    removed = store.evict(Budget(max_bytes=max_bytes, min_age=args.min_age))
    entries, total = store.usage()
    print(f"removed {removed} least recently used entries; {store.root} now holds {entries} entries, {human_bytes(total)} (was {human_bytes(before[1])})")
    if total > max_bytes:
        print(
            f"still above {human_bytes(max_bytes)}: the rest may have been used within --min-age {args.min_age:.0f} s (plus a minute: a daemon records a use on disk at most once a minute)"
        )
    return 0


def clear(args) -> int:
    from ..store import Budget
    from ..store.budget import extra_files

    store = open_store(args, changes="clear")
    before, binaries = store.usage(), len(extra_files(store))
    removed = store.evict(Budget(max_bytes=0, max_entries=0, min_age=float("-inf")))  # nothing is kept
    after, binaries_left = store.usage(), len(extra_files(store))
    print(f"removed {removed} entries and {binaries - binaries_left} device binaries from {store.root} ({human_bytes(before[1] - after[1])} freed)")
    if after[0] or binaries_left:  # published or built meanwhile by a daemon serving this cache
        print(f"left {after[0]} entries and {binaries_left} device binaries made while this ran ({human_bytes(after[1])})")
        return 1
    return 0


def _local_kinds(args) -> list[dict]:
    """The kinds a daemon started here with the same flags would serve."""
    import kernels
    from kernels import plugins

    plugins.load(tuple(args.kernel_modules or ()), entry_points=True)
    return [{**kind.describe(), "origin": kernels.origin(name)} for name, kind in sorted(kernels.kinds().items())]


def kinds(args) -> int:
    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        kinds = [wire.kind_from_proto(k) for k in ask(args.socket, "ListKinds", pb.ListKindsRequest()).kinds]
        source = "the running daemon"
    except ConnectionError as exc:
        if args.socket or not isinstance(exc, NoDaemon):  # a daemon was named, or one not to be trusted answers: say so rather than guess
            return fail(str(exc))
        try:
            kinds, source = _local_kinds(args), "this installation (no daemon running)"
        except ValueError as exc:  # a bad --kernel-module
            return fail(str(exc), 2)
    if args.json:
        print(json.dumps(kinds, indent=2))
        return 0
    print(f"kernel kinds served by {source}:")
    for kind in kinds:
        print(f"\n{kind['name']}  [{kind['origin']}]\n  {kind['doc']}")
        for p in kind["params"]:
            print(f"    {p['name']:<12} {p['type']:<5} {_param_label(p)}  {p['doc']}")
    return 0


def _param_label(p: dict) -> str:
    """A parameter's default as `kinds` prints it. None means one of two things: for a size
    (required, or with a default of its own) a runtime size, one kernel for every value; as
    the default itself (tiles such as threads) the kind's own choice for the target."""
    if p["required"]:
        label = "required"
    elif p.get("default") is None:
        label = "default None: the kind chooses"
    else:
        label = f"default {json.dumps(p['default'])}"
    if p.get("choices"):
        label += f", one of {', '.join(map(str, p['choices']))}"
    if p["nullable"] and (p["required"] or p.get("default") is not None):
        label += ", None: runtime size"
    return label


def manifest(args) -> int:
    from kernels.spec import InvalidSpec
    from proto import manifest

    from .. import apps
    from ..fsutil import write_text_atomic

    cache_dir = cache_dir_of(args)
    try:
        specs = apps.read(cache_dir, args.app)
    except InvalidSpec as exc:
        return fail(str(exc), 2)
    if not specs:
        known = ", ".join(apps.recorded(cache_dir)) or "none"
        return fail(
            f"no kernels recorded for application {args.app!r} in {cache_dir} (recorded: {known}); "
            "clients name their application with client.connect(app=NAME) or KERNEL_SERVICE_APP=NAME"
        )
    text = manifest.dumps(manifest.make(args.app, specs))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        write_text_atomic(Path(args.output), text, mode=0o644)  # meant to be read, shared, committed
        print(f"wrote {len(specs)} kernels of {args.app} to {args.output}", file=sys.stderr)
    return 0


def _value(text: str):
    """A parameter value from the command line: none/null, true/false, an int, a float, else a string."""
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def explain(args) -> int:
    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    params = {}
    for item in args.params:
        name, eq, value = item.partition("=")
        if not eq or not name:
            return fail(f"{item!r}: parameters are NAME=VALUE, e.g. N=4096 dtype=float16 M=none", 2)
        params[name] = _value(value)
    try:
        request = pb.ExplainRequest(spec=wire.spec_to_proto(args.kind, params, args.target))
        answer = wire.explanation_from_proto(ask(args.socket, "Explain", request))
    except ValueError as exc:  # InvalidSpec included: "<field>: <message>"
        return fail(str(exc), 2)
    except ConnectionError as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0 if answer["hit"] else 1
    spec = answer["spec"]
    print(f"{'HIT' if answer['hit'] else 'MISS'}  {label({**spec['params'], 'kind': spec['kind'], 'target': spec['target']})}")
    print(f"  key        {answer['key']}")
    print(f"  toolchain  {' '.join(f'{k}={show(v)}' for k, v in answer['toolchain'].items())}")
    if not answer["hit"]:
        print(f"  why        {answer['reason']}")
        for near in answer["nearest"]:
            print(f"  near       {near['key'][:16]}  differs in {', '.join(d['text'] for d in near['differences']) or 'nothing (keyed by another version)'}")
    if answer["failure"]:  # in full: the error a GetKernel gets may be cut to fit gRPC's metadata
        print("  failure    " + answer["failure"].replace("\n", "\n             "))
    return 0 if answer["hit"] else 1
