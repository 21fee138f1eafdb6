"""`kernel-service`: serve, stop, info, stats, zero-stats, kinds, ls, prune, clear, verify;
manifest, prewarm, bundle export|import, explain (no compiling while serving).

Commands that ask a running daemon (stats, zero-stats, kinds, info) speak the
wire contract (proto/) directly: the daemon's package never imports the client
library. Commands on the cache (ls, prune, clear, verify) read it on disk and
are safe while a daemon serves it. Every failure is one line on stderr, naming
the problem and the fix, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path


def _fail(message: str, status: int = 1) -> int:
    print(f"kernel-service: {message}", file=sys.stderr)
    return status


def _resolve(args):
    """The configuration `serve` with these flags resolves to (ValueError: a bad flag)."""
    from .config import SETTINGS, ServiceConfig

    return ServiceConfig.resolve(**{name: getattr(args, name) for name in SETTINGS})


def _serve(args) -> int:
    from kernels.plugins import KernelModuleError
    from proto.trust import UntrustedPath

    from .server import Daemon, StartError

    try:
        config = _resolve(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        Daemon(config).serve_forever(parent=os.getppid() if args.exit_with_parent else None)
    except KernelModuleError as exc:  # a bad --kernel-module, found when the daemon loads it
        return _fail(str(exc), 2)
    except UntrustedPath as exc:  # says in one line what is wrong and what to do about it
        return _fail(exc.strerror or str(exc))
    except (StartError, ImportError, LookupError, TypeError, RuntimeError) as exc:  # plugins included
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    return 0


def _verify(args) -> int:
    from .store.check import verify

    store = _open_store(args, changes="verify --repair" if args.repair else None)
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


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class NoDaemon(ConnectionError):
    """No daemon answers on the socket."""


def _ask(socket: str | None, rpc: str, request, timeout: float = 10, metadata: tuple = ()):
    """One call to the daemon at `socket` (default: the default socket) through the contract's
    stubs, after the client's own trust checks (proto.channel.verify_daemon: the socket's
    directory and the peer's uid; the uid expected is $KERNEL_SERVICE_DAEMON_UID, else ours).
    Raises NoDaemon at once when none answers, UntrustedService (a ConnectionError) when the
    one answering is not to be trusted, InvalidSpec (a ValueError) when it refuses the request
    as invalid, ConnectionError on any other failure (its message from proto/channel.py)."""
    import grpc

    from proto import channel
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

    address = channel.target(socket)
    where = address.removeprefix("unix:")
    path = channel.socket_path(address)
    gone = f"no kernel-service daemon answers at {where} (its socket file is there, left by a daemon that was killed); start one with `kernel-service serve`"
    if path is not None:
        if not path.exists():
            raise NoDaemon(f"no kernel-service daemon at {where}; start one with `kernel-service serve`")
        try:
            channel.verify_daemon(path, channel.daemon_uid())
        except channel.NotListening:
            raise NoDaemon(gone) from None
        except channel.UntrustedService:
            raise
        except channel.ServiceUnavailable as exc:
            raise NoDaemon(str(exc)) from None
    with channel.open_channel(address) as ch:
        try:
            return getattr(pb_grpc.KernelServiceStub(ch), rpc)(request, timeout=timeout, metadata=(channel.auth_metadata(address) or ()) + metadata)
        except grpc.RpcError as err:
            exc = channel.error_for(err, f"the daemon at {where}", where)
    if isinstance(exc, channel.ServiceUnavailable):
        raise NoDaemon(gone if path is not None else str(exc))  # over TCP, what gRPC says (a TLS daemon closes plaintext connections)
    if isinstance(exc, ValueError):
        raise exc
    raise ConnectionError(str(exc))  # one line for the caller to print, whatever the status


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _stats(args) -> int:
    from proto.channel import fields_of
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        stats = fields_of(_ask(args.socket, "GetStats", pb.GetStatsRequest()))
    except ConnectionError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(
        f"counters since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stats['stats_since']))} ({_ago(stats['stats_since'])}; `kernel-service zero-stats` resets them):"
    )
    for name in (
        "compiles",
        "derived",
        "hits",
        "direct_hits",
        "misses",
        "joined",
        "failures",
        "failures_cached",
        "invalid",
        "corrupt",
        "evictions",
        "not_ready",
    ):
        print(f"{name:>16}: {stats[name]}")
    print(f"{'compile_seconds':>16}: {stats['compile_seconds']:.2f} (device code: {stats['device_compile_seconds']:.2f})")
    print("now:")
    print(f"{'in_flight':>16}: {stats['in_flight']} ({stats['running']} running, {stats['queued']} queued)")
    print(f"{'workers':>16}: {stats['workers']} ({stats['workers_ready']} ready)")
    print(f"{'cpu_quota':>16}: {stats['cpu_quota']}")
    print(f"{'entries':>16}: {stats['entries']}")
    print(f"{'bytes':>16}: {stats['bytes']} ({_human_bytes(int(stats['bytes']))})")
    print(f"{'inductor':>16}: {stats['inductor_dir']} ({stats['inductor_entries']} files, {_human_bytes(int(stats['inductor_bytes']))})")
    for name in ("cache_dir", "address", "version", "toolchain", "cuda_compiler"):
        print(f"{name:>16}: {stats[name]}")
    print(f"{'uptime':>16}: {stats['uptime_seconds']:.0f} s")
    if stats["remote"]:
        mode = " read-only" if stats["remote_read_only"] else ""
        print(f"{'remote':>16}: {stats['remote']} ({stats['remote_state']}{mode})")
        for name in ("remote_hits", "remote_misses", "remote_lease_waits", "remote_takeovers", "remote_errors", "remote_corrupt"):
            print(f"{name:>16}: {stats[name]}")
        print(f"{'remote_bytes':>16}: {_human_bytes(int(stats['remote_bytes_in']))} in, {_human_bytes(int(stats['remote_bytes_out']))} out")
    return 0


def _zero_stats(args) -> int:
    from proto.channel import fields_of
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.paths import ADMIN_METADATA, ADMIN_TOKEN_FILE, default_cache_dir

    from .metrics import STATS_FILE, Metrics

    try:
        # Owner-only: the call carries the admin secret the daemon wrote under its cache root.
        admin = Path(_ask(args.socket, "GetServiceInfo", pb.GetServiceInfoRequest()).cache_dir) / ADMIN_TOKEN_FILE
        try:
            secret = admin.read_text().strip()
        except OSError as exc:
            return _fail(f"cannot read the daemon's admin secret {admin} ({exc.strerror}): zero-stats is for the daemon's owner; run it as that user")
        before = fields_of(_ask(args.socket, "ZeroStats", pb.ZeroStatsRequest(), metadata=((ADMIN_METADATA, secret),)))
        print(
            f"counters of the daemon at {before['address']} set to zero (it had {before['compiles']} compiles, {before['hits']} hits, {before['misses']} misses)"
        )
        return 0
    except NoDaemon:
        pass  # no daemon: zero the totals the next one starts from
    except ConnectionError as exc:
        return _fail(str(exc))
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if not (cache_dir / "entries").is_dir():
        return _fail(f"{cache_dir} is not a kernel cache; pass --cache-dir, or --socket of a running daemon")
    Metrics().save(cache_dir / STATS_FILE)
    print(f"no daemon running; the counters kept in {cache_dir / STATS_FILE} set to zero")
    return 0


def _exited(pid: int) -> bool:
    """Has process `pid` exited? A zombie has: only its parent's wait is missing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _stop(args) -> int:
    from proto.paths import default_socket

    from .stopping import NotTheDaemon, terminate

    socket = Path(args.socket) if args.socket else default_socket()
    refuse = "refusing to signal it; stop the daemon as its owner, or with the supervisor that started it"
    try:
        pid = terminate(socket)
    except NotTheDaemon as exc:
        return _fail(f"{exc}: {refuse}")
    except PermissionError:
        return _fail(f"the daemon on {socket} belongs to another user; stop it as that user")
    if pid is None:
        print(f"no kernel-service daemon is running on {socket}")
        return 0
    deadline = time.monotonic() + args.timeout
    while not _exited(pid):  # it drains, then it exits
        if time.monotonic() > deadline:
            return _fail(
                f"the daemon (pid {pid}) is still draining after {args.timeout:.0f} s; wait, or `kill -9 {pid}` to stop it at once (checked: the daemon serving {socket})"
            )
        time.sleep(0.1)
    print(f"stopped the daemon on {socket} (pid {pid})")
    return 0


def _info(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    from .config import SETTINGS

    try:
        config = _resolve(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        reply = _ask(str(config.socket), "GetServiceInfo", pb.GetServiceInfoRequest())
        settings, origin = json.loads(reply.config_json), f"the daemon running on {config.socket}"
    except NoDaemon:
        settings, origin = config.describe(), f"`kernel-service serve` with these flags (no daemon is running on {config.socket})"
    except ConnectionError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps({"from": origin, "settings": settings}, indent=2, sort_keys=True))
        return 0
    print(f"configuration of {origin}:")
    order = list(SETTINGS)  # as `serve --help` lists them; fields that are no setting last
    width = max(map(len, settings), default=0)
    for name in sorted(settings, key=lambda n: order.index(n) if n in order else len(order)):
        item = settings[name]
        print(f"  {name:<{width}}  {json.dumps(item['value']):<40} {item['source']}")
    return 0


def _open_store(args, changes: str | None = None):
    """The cache at --cache-dir (default: the daemon's default), for the commands that work on disk;
    `changes`: the command, when it may remove things (never from a read-only layer)."""
    from proto.paths import default_cache_dir

    from .layout import counted_dirs
    from .store import LocalStore
    from .store.layers import is_layer

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if changes and is_layer(cache_dir):
        raise SystemExit(_fail(f"{cache_dir} is a read-only cache layer (its owner may not write it): `kernel-service {changes}` never changes one", 2))
    try:
        return LocalStore(cache_dir, create=False, extra_usage=counted_dirs(cache_dir))
    except OSError as exc:
        raise SystemExit(_fail(f"{exc.strerror or exc}; pass --cache-dir the cache root a daemon uses (see `kernel-service info`)", 2))


def _ls(args) -> int:
    from .store.listing import list_entries

    store = _open_store(args)
    entries = list_entries(store)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        params = ",".join(f"{k}={v}" for k, v in e["params"].items() if not k.startswith(("block_", "num_", "threads")))  # M=None shown: a runtime size
        built = f"copy of {e['shared_build'][:12]}" if e["built"] == "copy" else f"compiled in {e['compile_seconds']:.2f}s"
        compiler = f" {e['cuda_compiler']}" if e["cuda_compiler"] and e["target"] != "c" else ""
        print(f"{e['key'][:12]}  {e['kind']:<9} {e['target']:<7} {_human_bytes(e['bytes']):>9}  used {_ago(e['last_used']):<11} {built}{compiler}  {params}")
    entries_count, total = store.usage()
    print(f"{store.root}: {entries_count} entries, {_human_bytes(total)} in all (blobs and device binaries included)")
    return 0


def _prune(args) -> int:
    from .config import parse_size
    from .store import Budget

    try:
        max_bytes = parse_size(args.max_size)
    except ValueError as exc:
        return _fail(f"--max-size: {exc}", 2)
    store = _open_store(args, changes="prune")
    before = store.usage()
    removed = store.evict(Budget(max_bytes=max_bytes, min_age=args.min_age))
    entries, total = store.usage()
    print(f"removed {removed} least recently used entries; {store.root} now holds {entries} entries, {_human_bytes(total)} (was {_human_bytes(before[1])})")
    if total > max_bytes:
        print(
            f"still above {_human_bytes(max_bytes)}: the rest may have been used within --min-age {args.min_age:.0f} s (plus a minute: a daemon records a use on disk at most once a minute)"
        )
    return 0


def _clear(args) -> int:
    from .store import Budget
    from .store.budget import extra_files

    store = _open_store(args, changes="clear")
    before, binaries = store.usage(), len(extra_files(store))
    removed = store.evict(Budget(max_bytes=0, max_entries=0, min_age=float("-inf")))  # nothing is kept
    after, binaries_left = store.usage(), len(extra_files(store))
    print(f"removed {removed} entries and {binaries - binaries_left} device binaries from {store.root} ({_human_bytes(before[1] - after[1])} freed)")
    if after[0] or binaries_left:  # published or built meanwhile by a daemon serving this cache
        print(f"left {after[0]} entries and {binaries_left} device binaries made while this ran ({_human_bytes(after[1])})")
        return 1
    return 0


def _local_kinds(args) -> list[dict]:
    """The kinds a daemon started here with the same flags would serve."""
    import kernels
    from kernels import plugins

    plugins.load(tuple(args.kernel_module), entry_points=True)
    return [{**kind.describe(), "origin": kernels.origin(name)} for name, kind in sorted(kernels.kinds().items())]


def _kinds(args) -> int:
    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        kinds = [wire.kind_from_proto(k) for k in _ask(args.socket, "ListKinds", pb.ListKindsRequest()).kinds]
        source = "the running daemon"
    except ConnectionError as exc:
        if args.socket or not isinstance(exc, NoDaemon):  # a daemon was named, or one not to be trusted answers: say so rather than guess
            return _fail(str(exc))
        try:
            kinds, source = _local_kinds(args), "this installation (no daemon running)"
        except ValueError as exc:  # a bad --kernel-module
            return _fail(str(exc), 2)
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


def _os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror or str(exc)


def _manifest(args) -> int:
    from kernels.spec import InvalidSpec
    from proto import manifest
    from proto.paths import default_cache_dir

    from . import apps
    from .fsutil import write_text_atomic

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        specs = apps.read(cache_dir, args.app)
    except InvalidSpec as exc:
        return _fail(str(exc), 2)
    if not specs:
        known = ", ".join(apps.recorded(cache_dir)) or "none"
        return _fail(
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


def _load_manifests(paths: list[str]) -> list[dict]:
    """The distinct specs of the manifests, in order; raises ManifestError."""
    from proto import manifest

    seen, specs = set(), []
    for path in paths:
        for spec in manifest.specs(path):
            text = json.dumps(spec, sort_keys=True)
            if text not in seen:
                seen.add(text)
                specs.append(spec)
    return specs


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _label(spec: dict) -> str:
    params = " ".join(f"{k}={_show(v)}" for k, v in spec.items() if k not in ("kind", "target"))
    return f"{spec['kind']} {params} on {spec['target']}"


def _prewarm(args) -> int:
    import grpc

    from proto import channel, wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
    from proto.manifest import ManifestError

    try:
        specs = _load_manifests(args.manifests)
    except ManifestError as exc:
        return _fail(str(exc), 2)
    if args.remote:
        return _prewarm_tier(args, specs)
    address = channel.target(args.socket)
    try:  # one Prefetch may queue a quarter of the daemon's --queue-limit compiles: batches that fit
        config = json.loads(_ask(args.socket, "GetServiceInfo", pb.GetServiceInfoRequest()).config_json or "{}")
    except ConnectionError as exc:
        return _fail(str(exc))
    batch_size = max(1, min(wire.MAX_BATCH, config.get("queue_limit", {}).get("value", 1024) // 4))
    built, present, failed = [], [], []  # failed: (spec, reason)
    bar = _progress(len(specs))
    todo = list(range(len(specs)))
    metadata = channel.auth_metadata(address)  # readable: GetServiceInfo above carried it
    with channel.open_channel(address) as ch:
        stub = pb_grpc.KernelServiceStub(ch)
        while todo:
            batch = todo[:batch_size]
            request = pb.PrefetchRequest(specs=[wire.spec_to_proto(specs[i]["kind"], _params(specs[i]), specs[i]["target"]) for i in batch])
            try:
                for event in stub.Prefetch(request, timeout=args.timeout, metadata=metadata):
                    spec = specs[batch[event.index]]
                    if event.error_code:
                        failed.append((spec, f"{event.error_code}: {event.error_message}"))
                        word = "FAILED"
                    elif event.kernel.outcome == pb.OUTCOME_HIT:
                        present.append(spec)
                        word = "already there"
                    else:
                        built.append(spec)
                        word = "built"
                    bar(f"{word:<13} {_label(spec)}")
            except grpc.RpcError as err:
                # One invalid spec fails a whole batch before any work: report it, and prewarm the rest.
                refused = channel.refused_spec(err, len(batch))
                if refused is None:
                    return _fail(f"prewarm stopped: the daemon at {address} answered {err.code().name}: {err.details()}")
                i = batch[refused[0]]
                failed.append((specs[i], f"INVALID_ARGUMENT: {str(refused[1]).split(': ', 1)[-1]}"))
                bar(f"{'FAILED':<13} {_label(specs[i])}")
                todo.remove(i)
                continue
            todo = todo[len(batch) :]
    print(f"built {len(built)}, already there {len(present)}, failed {len(failed)} (of {len(specs)} kernels)")
    for spec, reason in failed:
        print(f"failed: {_label(spec)}: {reason.splitlines()[0] if reason else ''}")
    return 1 if failed else 0


def _prewarm_tier(args, specs: list[dict]) -> int:
    """prewarm --remote: no daemon. This process builds, with a daemon's own scheduler and
    workers, what the manifests list and the fleet tier lacks, and uploads it there (the
    write-behind of a daemon on the tier, waited for); it serves nothing. Builds stay in
    --cache-dir, by default a temporary directory removed at the end."""
    import shutil
    import tempfile

    import kernels
    from kernels import plugins
    from kernels.spec import InvalidSpec
    from proto.trust import private_dir

    from .build import devices
    from .build.compiler import DEVICE_BINARIES, device_binary_dir
    from .config import remote_url, resolve_setting, without_password
    from .cpus import usable_cpus
    from .metrics import Metrics
    from .scheduler import URGENT, Scheduler
    from .store import LocalStore
    from .store.remote import RedisTier, TierUnavailable
    from .store.tiered import with_fleet_tier
    from .workers import process_pool

    try:
        remote_url(args.remote)
        device = devices.choose(args.cuda_compiler)
        plugins.load(modules=tuple(args.kernel_module))
    except (ValueError, ImportError, LookupError) as exc:  # KernelModuleError included
        return _fail(str(exc), 2)
    try:
        start, _ = resolve_setting("worker_start", args.worker_start)  # as serve resolves it
    except ValueError as exc:
        return _fail(str(exc), 2)
    url = without_password(args.remote)
    root = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="kernel-service-prewarm-"))
    metrics = Metrics()
    store = scheduler = None
    try:
        store = LocalStore(root, metrics=metrics)
        for d in (root / DEVICE_BINARIES, device_binary_dir(root, device.id)):
            private_dir(d, 0o700, "cache directory", "choose another --cache-dir")
        fleet = with_fleet_tier(store, RedisTier(args.remote, metrics=metrics), metrics).claims
        workers = args.workers or usable_cpus()
        plugin_args = {"modules": tuple(args.kernel_module)}
        pool = functools.partial(process_pool, start=start, early=False)  # no zygote unless there is something to build
        scheduler = Scheduler(store, fleet, workers, len(specs) + 1, plugin_args, device=device, metrics=metrics, pool=pool, start=False)
        wanted, failed = [], []  # wanted: (manifest spec, canonical spec); failed: (spec, reason)
        for spec in specs:
            try:
                wanted.append((spec, kernels.canonicalize(spec["kind"], _params(spec), spec["target"])))
            except InvalidSpec as exc:
                failed.append((spec, f"INVALID_ARGUMENT: {exc}"))
        builds = {id(c): scheduler.build_keys(c) for _, c in wanted}
        every = sorted({k for keys in builds.values() for k in keys})
        try:
            there = dict(zip(every, fleet.tier.present(every)))
        except TierUnavailable as exc:
            return _fail(f"cannot reach the fleet tier {url}: {exc}")
        bar = _progress(len(specs))
        for spec, reason in failed:
            bar(f"{'FAILED':<13} {_label(spec)}")
        present = [spec for spec, c in wanted if all(there[k] for k in builds[id(c)])]
        for spec in present:
            bar(f"{'already there':<13} {_label(spec)}")
        todo = [(spec, c) for spec, c in wanted if not all(there[k] for k in builds[id(c)])]
        if todo:
            scheduler.start_workers()  # forked from the zygote once its TileLang import is done: only when there is something to build
        pending = {scheduler.request(c, URGENT)[0]: spec for spec, c in todo}
        built = []
        deadline = time.monotonic() + args.timeout
        for future in _as_completed(pending, deadline):
            spec = pending[future]
            if future.exception() is None:
                built.append(spec)
                bar(f"{'built':<13} {_label(spec)}")
            else:
                failed.append((spec, f"{type(future.exception()).__name__}: {future.exception()}"))
                bar(f"{'FAILED':<13} {_label(spec)}")
        failed += [(spec, f"not built within --timeout {args.timeout:g}s") for future, spec in pending.items() if not future.done()]
        # Uploaded? A build found in --cache-dir was never queued for upload: share it now.
        fleet.flush(max(1.0, deadline - time.monotonic()))
        done = {id(spec) for spec in built}
        keys = sorted({k for spec, c in wanted if id(spec) in done for k in builds[id(c)]})
        for key, up in zip(keys, fleet.tier.present(keys)):
            entry = None if up else store.lookup(key)
            if entry is not None:
                fleet.share(entry)
        fleet.flush(max(1.0, deadline - time.monotonic()))
        missing = {k for k, up in zip(keys, fleet.tier.present(keys)) if not up}
        for spec, c in wanted:
            if id(spec) in done and missing & set(builds[id(c)]):
                built.remove(spec)
                failed.append((spec, f"built, but not in the fleet tier {url} after uploading (see the warnings above)"))
    except TierUnavailable as exc:
        return _fail(f"the fleet tier {url} failed: {exc}")
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    finally:
        if scheduler is not None:
            scheduler.shutdown(10.0)
        if store is not None:
            store.close()
        if not args.cache_dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"built {len(built)}, already there {len(present)}, failed {len(failed)} (of {len(specs)} kernels) in the fleet tier {url}")
    for spec, reason in failed:
        print(f"failed: {_label(spec)}: {reason.splitlines()[0] if reason else ''}")
    return 1 if failed else 0


def _as_completed(futures, deadline: float):
    """concurrent.futures.as_completed until `deadline` (time.monotonic()); what is left then is not yielded."""
    import concurrent.futures as cf

    try:
        yield from cf.as_completed(futures, timeout=max(0.0, deadline - time.monotonic()))
    except cf.TimeoutError:
        return


def _params(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in ("kind", "target")}


def _progress(total: int):
    """`step(line)` per finished kernel: a tqdm bar when tqdm is installed and the output is a
    terminal, else one plain line each."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(total=total, unit="kernel", file=sys.stderr)

        def step(line: str) -> None:
            bar.update(1)
            bar.set_postfix_str(line[:60])

        return step
    done = 0

    def step(line: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done:>{len(str(total))}}/{total}] {line}", flush=True)

    return step


def _keying_compiler(args) -> str:
    """The device compiler id CUDA keys are made with: --cuda-compiler-id (a host that does not
    compile, serving a builder's entries), else the compiler --cuda-compiler picks here."""
    import os

    from .build import devices

    named = args.cuda_compiler_id or os.environ.get(devices.ID_ENV)
    return devices.named(named).id if named else devices.choose(args.cuda_compiler).id


def _bundle_export(args) -> int:
    import kernels
    from kernels import plugins
    from proto.paths import default_cache_dir

    from . import provenance
    from .bundle import BundleError, export
    from .store import LocalStore

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        compiler = _keying_compiler(args)
        plugins.load(tuple(args.kernel_module), entry_points=True)
        specs = _load_manifests([args.manifest])
        if args.target is not None:
            kernels.parse_target(args.target)
    except ValueError as exc:  # a bad --cuda-compiler(-id) or --target, or no manifest (ManifestError)
        return _fail(str(exc), 2)
    try:
        canonical = [kernels.canonicalize(s["kind"], _params(s), s["target"]) for s in specs]
    except ValueError as exc:  # InvalidSpec: "<field>: <message>"
        return _fail(f"{args.manifest}: {exc}", 2)
    try:
        store = LocalStore(cache_dir, create=False)
        key = None
        if not args.no_sign:
            key = provenance.load_signing_key(args.signing_key) if args.signing_key else provenance.cache_signing_key(cache_dir)
        summary = export(store, canonical, compiler, Path(args.output), key, args.target)
    except (BundleError, provenance.ProvenanceError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # no cache there
        return _fail(_os_error(exc))
    signed = f"signed by {summary['signed_by']}" if summary["signed_by"] else "unsigned"
    print(f"wrote {args.output}: {summary['entries']} entries, {summary['blobs']} files, {_human_bytes(summary['bytes'])}, {signed}")
    return 0


def _bundle_policy(args):
    """What import and verify accept, from --trusted-key (else $KERNEL_SERVICE_TRUSTED_KEYS),
    --trust-unsigned, --target and --any-arch; raises ProvenanceError, or ValueError for --target."""
    import kernels

    from . import provenance
    from .bundle import Policy

    if args.target is not None:
        kernels.parse_target(args.target)
    keys = provenance.load_trusted_keys(provenance.trusted_key_paths(args.trusted_key))
    return Policy(trusted_keys=keys, trust_unsigned=args.trust_unsigned, host_target=args.target, any_arch=args.any_arch)


def _bundle_import(args) -> int:
    from kernels import plugins
    from proto.paths import default_cache_dir

    from . import provenance
    from .bundle import BundleError, import_, import_layer
    from .store import LocalStore, existing_mode

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        plugins.load(tuple(args.kernel_module), entry_points=True)
        compiler = _keying_compiler(args)
        policy = _bundle_policy(args)
        if args.layer:
            where = Path(args.layer)
            report = import_layer(where, Path(args.bundle), compiler, policy)
        else:
            where = cache_dir
            report = import_(LocalStore(cache_dir, existing_mode(cache_dir)), Path(args.bundle), compiler, policy)
    except (BundleError, provenance.ProvenanceError) as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc), 2)
    except OSError as exc:  # the cache refused a write (StoreError), or cannot be created
        return _fail(_os_error(exc))
    what = "a read-only layer at" if args.layer else "the cache"
    print(
        f"imported {report.imported} entries into {what} {where} ({report.present} already there; {report.digests_checked} files' sha256 checked, "
        f"{_human_bytes(report.bytes)}; {report.provenance})"
    )
    return 0


def _bundle_verify(args) -> int:
    from kernels import plugins

    from . import provenance
    from .bundle import BundleError, verify

    try:
        plugins.load(tuple(args.kernel_module), entry_points=True)
        compiler = _keying_compiler(args)
        report = verify(Path(args.bundle), compiler, _bundle_policy(args))
    except (BundleError, provenance.ProvenanceError) as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc), 2)
    arches = ", ".join(f"{arch} {n}" for arch, n in sorted(report.arches.items()))
    print(
        f"{args.bundle}: would import: {report.entries} entries ({arches}), {report.digests_checked} files' sha256 checked, "
        f"{_human_bytes(report.bytes)}; toolchain and keys match this host; {report.provenance}"
    )
    return 0


def _bundle_info(args) -> int:
    from .bundle import BundleError, info

    try:
        about = info(Path(args.bundle))
    except BundleError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(about, indent=1))
        return 0
    signed = about["signed_by"] or "unsigned"
    print(
        f"{about['path']}: bundle version {about['version']}, {about['compression']} compression, {_human_bytes(about['bytes'])}, "
        f"{len(about['entries'])} entries, {about['files']} files ({_human_bytes(about['file_bytes'])} unpacked), "
        f"{signed} (not checked against trusted keys: `bundle verify` does)"
    )
    print("toolchain  " + " ".join(f"{k}={v}" for k, v in sorted(about["toolchain"].items())))
    for title, group in (("kind", "by_kind"), ("arch", "by_arch")):
        for name, t in about[group].items():
            print(f"{title:<5} {name:<16} {t['entries']:>5} entries  {_human_bytes(t['bytes']):>10}")  # shared files in each entry
    for row in about["entries"]:
        params = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(row["params"].items()))
        print(f"  {row['kind']:<10} {row['target']:<7} {_human_bytes(row['bytes']):>10}  {params}")
    return 0


def _bundle_key(args) -> int:
    from proto.paths import default_cache_dir

    from . import provenance
    from .store import LocalStore

    try:
        if args.signing_key:
            key = provenance.load_signing_key(args.signing_key)
        else:
            cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
            LocalStore(cache_dir, create=False)  # the cache's owner, on a cache that exists: its root is trusted
            key = provenance.cache_signing_key(cache_dir)
    except provenance.ProvenanceError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(_os_error(exc))
    print(provenance.public_pem(key), end="")
    print(f"# {provenance.key_id(key.public_key())}: pass this file to `bundle import --trusted-key`", file=sys.stderr)
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


def _explain(args) -> int:
    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    params = {}
    for item in args.params:
        name, eq, value = item.partition("=")
        if not eq or not name:
            return _fail(f"{item!r}: parameters are NAME=VALUE, e.g. N=4096 dtype=float16 M=none", 2)
        params[name] = _value(value)
    try:
        request = pb.ExplainRequest(spec=wire.spec_to_proto(args.kind, params, args.target))
        answer = wire.explanation_from_proto(_ask(args.socket, "Explain", request))
    except ValueError as exc:  # InvalidSpec included: "<field>: <message>"
        return _fail(str(exc), 2)
    except ConnectionError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0 if answer["hit"] else 1
    spec = answer["spec"]
    print(f"{'HIT' if answer['hit'] else 'MISS'}  {_label({**spec['params'], 'kind': spec['kind'], 'target': spec['target']})}")
    print(f"  key        {answer['key']}")
    print(f"  toolchain  {' '.join(f'{k}={_show(v)}' for k, v in answer['toolchain'].items())}")
    if not answer["hit"]:
        print(f"  why        {answer['reason']}")
        for near in answer["nearest"]:
            print(f"  near       {near['key'][:16]}  differs in {', '.join(d['text'] for d in near['differences']) or 'nothing (keyed by another version)'}")
    if answer["failure"]:  # in full: the error a GetKernel gets may be cut to fit gRPC's metadata
        print("  failure    " + answer["failure"].replace("\n", "\n             "))
    return 0 if answer["hit"] else 1


def _shown_default(name: str, setting) -> str:
    from .config import _DEFAULTS

    if setting.default_text:
        return setting.default_text
    value = _DEFAULTS[name]
    return "none" if value in (None, ()) else f"{value:g}" if isinstance(value, float) else str(value)


def _flag_type(parse):
    """An argparse type from a parse function (a setting's, a Range's): its ValueError's message is what argparse says."""
    if parse is str:
        return None

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _setting_help(name: str, setting) -> str:
    if setting.form == "switch":
        return f"{setting.help} (or ${setting.env}=1)"
    default = _shown_default(name, setting)
    more = f"repeatable, ${setting.env} holds several, '{setting.split}'-separated; " if setting.form == "repeat" else ""
    return f"{setting.help} ({more}default: ${setting.env}, else {default})"


def add_setting_flags(p: argparse.ArgumentParser, before_command: bool = False) -> None:
    """The flags that configure a daemon, one per setting of ServiceConfig (config.py): `serve`
    takes them, `info` shows what they resolve to; the logging settings' flags come before any
    command (`before_command`). A flag not given is None: the setting's variable or default
    applies (ServiceConfig.resolve)."""
    from .config import _DEFAULTS, SETTINGS

    groups = {}
    for name, s in SETTINGS.items():
        if s.before_command != before_command:
            continue
        into = p if s.group is None else groups.setdefault(s.group, p.add_argument_group(s.group))
        how = {"dest": name, "default": None, "help": _setting_help(name, s).replace("%", "%%")}
        if s.form == "switch":
            how.update(action="store_const", const=not _DEFAULTS[name])
        else:
            how.update(metavar=s.metavar, type=_flag_type(s.parse), choices=s.choices, action="append" if s.form == "repeat" else "store")
        into.add_argument(s.flag, **how).setting = True  # marked for cli_markdown, which lists settings apart


def _cell(text: str) -> str:
    """Text in a markdown table's cell."""
    return text.replace("|", "\\|")


def settings_markdown() -> str:
    """The daemon settings as a markdown table: setting, flag, variable, default, meaning."""
    from .config import SETTINGS

    rows = ["| setting | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for name, s in SETTINGS.items():
        flag = f"{s.flag} {s.metavar}" if s.metavar else s.flag
        flag += " (repeatable)" if s.form == "repeat" else ""
        flag += " (before the command)" if s.before_command else ""
        default = "off" if s.form == "switch" else _shown_default(name, s)
        env = f"`{s.env}=1`" if s.form == "switch" else f"`{s.env}` (`{s.split}`-separated)" if s.form == "repeat" else f"`{s.env}`"
        rows.append(f"| `{name}` | `{_cell(flag)}` | {env} | {_cell(default)} | {_cell(s.help)} |")
    return "\n".join(rows) + "\n"


def _flag_line(action: argparse.Action) -> str:
    flag = " ".join(action.option_strings) or action.metavar or action.dest
    if action.option_strings and action.nargs != 0:
        flag += f" {action.metavar or action.dest.upper()}"
    return f"| `{_cell(flag)}` | {_cell((action.help or '') % {'default': action.default})} |"


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/cli.md: every command and its flags, and the daemon's settings, from the parser itself."""
    parser = parser or build_parser()
    out = [
        "# `kernel-service`: commands, flags and settings",
        "",
        "<!-- Generated: `python -m compile_service.cli flags-markdown > docs/cli.md`. tests/test_cli.py fails when it and the command line disagree. -->",
        "",
        "Every failure is one line on stderr, naming the problem and the fix, and a non-zero exit (2: a bad flag).",
        "",
        "## Commands",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    for inner in nested[0]._choices_actions:
                        commands.append((f"{choice.dest} {inner.dest}", inner.help, nested[0].choices[inner.dest]))
                else:
                    commands.append((choice.dest, choice.help, sub))
    for name, help, _ in commands:
        out.append(f"| `{name}` | {help} |")
    out += [
        "",
        "## Daemon settings",
        "",
        "`serve` takes these flags; `info` takes them too and shows what they resolve to and where each value came from.",
        "Each setting takes its flag, else its environment variable, else its default. The variable is the flag's name in capitals after",
        "`KERNEL_SERVICE_` (plural for a repeatable flag); a switch's is set by `1`, `true`, `yes` or `on`. The logging settings'",
        "flags come before the command, for every command: `kernel-service --log-format json serve`.",
        "",
        settings_markdown().rstrip("\n"),
        "",
        "## Flags of each command",
    ]
    for name, _, sub in commands:
        own = [a for a in sub._actions if not isinstance(a, argparse._HelpAction) and not getattr(a, "setting", False)]
        out += ["", f"### `kernel-service {name}`", ""]
        if any(getattr(a, "setting", False) for a in sub._actions):
            out += ["Every daemon setting's flag (above), and:" if own else "Every daemon setting's flag (above).", ""]
        out += ["| flag or argument | meaning |", "|---|---|", *(_flag_line(a) for a in own)] if own else ["No flags."]
    return "\n".join(out).rstrip("\n") + "\n"


def _flags_markdown(args) -> int:
    sys.stdout.write(cli_markdown())
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line too, naming the command's --help."""

    def error(self, message: str):
        self.exit(2, f"kernel-service: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .config import POSITIVE_SECONDS, SETTINGS, SIZE_FORMS, WORKER_STARTS

    parser = _Parser(prog="kernel-service", description="TileLang kernel-compilation daemon")
    parser.add_argument("--version", action="version", version=f"kernel-service {__version__}")
    add_setting_flags(parser, before_command=True)  # --log-level, --log-format
    sub = parser.add_subparsers(dest="command", required=True)
    cache_help = "cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)"
    socket_help = "Unix socket path of the daemon (default $KERNEL_SERVICE_SOCKET, then the XDG path)"

    serve = sub.add_parser("serve", help="run the daemon until SIGTERM or `kernel-service stop`")
    add_setting_flags(serve)
    serve.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (draining, as on SIGTERM) within a second of the process that started this one exiting: for launchers such as tests and benchmarks, never under a supervisor",
    )
    serve.set_defaults(run=_serve)

    stop = sub.add_parser("stop", help="stop the daemon gracefully: it refuses new requests and lets running compiles finish (its --grace)")
    stop.add_argument("--socket", help=socket_help)
    stop.add_argument(
        "--timeout", type=_flag_type(POSITIVE_SECONDS.parse), default=60.0, help="seconds to wait for it to exit (default 60); exit 1 if it has not"
    )
    stop.set_defaults(run=_stop)

    info = sub.add_parser(
        "info", help="the resolved configuration and where each value came from: the running daemon's, else what `serve` with these flags would use"
    )
    add_setting_flags(info)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(run=_info)

    stats = sub.add_parser("stats", help="print the daemon's counters (totals since the last zero-stats; they survive restarts) and its state now")
    stats.add_argument("--socket", help=socket_help)
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(run=_stats)

    zero = sub.add_parser("zero-stats", help="set the counters to zero: the running daemon's, else those the next daemon on --cache-dir starts from")
    zero.add_argument("--socket", help=socket_help)
    zero.add_argument("--cache-dir", help=cache_help + "; used when no daemon runs")
    zero.set_defaults(run=_zero_stats)

    kinds = sub.add_parser("kinds", help="list the kernel kinds the daemon serves, with each parameter's type, default and meaning")
    kinds.add_argument("--socket", help="Unix socket path of the daemon (default: the default socket; without a daemon, the kinds installed here)")
    kinds.add_argument("--kernel-module", action="append", default=[], metavar="MODULE[:ATTR]", help="with no daemon: also list these modules' kinds")
    kinds.add_argument("--json", action="store_true", help="machine-readable output")
    kinds.set_defaults(run=_kinds)

    ls = sub.add_parser("ls", help="list the cache's entries, least recently used first: spec, size, last use, how built")
    ls.add_argument("--cache-dir", help=cache_help)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(run=_ls)

    prune = sub.add_parser("prune", help="remove least recently used entries (and device binaries) until the cache fits; safe while a daemon serves it")
    prune.add_argument("--max-size", required=True, metavar="SIZE", help=f"the size to fit in: {SIZE_FORMS}")
    prune.add_argument(
        "--min-age",
        type=_flag_type(SETTINGS["evict_min_age"].parse),
        default=300.0,
        metavar="SECONDS",
        help="keep entries used this recently, whatever the size (default 300, as serve --evict-min-age)",
    )
    prune.add_argument("--cache-dir", help=cache_help)
    prune.set_defaults(run=_prune)

    clear = sub.add_parser(
        "clear", help="remove every entry and device binary from the cache (torch.compile's directory is left alone); safe while a daemon serves it"
    )
    clear.add_argument("--cache-dir", help=cache_help)
    clear.set_defaults(run=_clear)

    verify = sub.add_parser("verify", help="check every cache entry against its manifest; exit 1 on damage left unrepaired")
    verify.add_argument("--cache-dir", help=cache_help)
    verify.add_argument("--repair", action="store_true", help="remove damaged entries and dead writers' staging dirs (safe while a daemon runs)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(run=_verify)

    manifest = sub.add_parser("manifest", help="write the kernels an application asked for (recorded by the daemon) as a manifest")
    manifest.add_argument("--app", required=True, help="the application's name, as its clients pass it (client.connect(app=NAME), KERNEL_SERVICE_APP)")
    manifest.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) instead of to stdout")
    manifest.add_argument("--cache-dir", help=cache_help)
    manifest.set_defaults(run=_manifest)

    prewarm = sub.add_parser("prewarm", help="build what the manifests list and the cache lacks, at prefetch priority; exit 1 if any failed")
    prewarm.add_argument("manifests", nargs="+", metavar="MANIFEST", help="manifest files (`kernel-service manifest -o FILE`)")
    prewarm.add_argument("--socket", help=socket_help)
    prewarm.add_argument("--timeout", type=_flag_type(POSITIVE_SECONDS.parse), default=3600.0, help="seconds the whole prewarm may take (default 3600)")
    prewarm.add_argument(
        "--remote",
        metavar="URL",
        help="fill this fleet tier (a redis:// URL with a writer's credentials) without any daemon: build here what it lacks and upload it; --socket is not used",
    )
    prewarm.add_argument("--cache-dir", help="with --remote: where the builds are kept (default: a temporary directory, removed at the end)")
    prewarm.add_argument("--cuda-compiler", choices=("auto", "nvrtc", "nvcc"), help="with --remote: how CUDA kernels are compiled, as for serve (default auto)")
    prewarm.add_argument("--workers", type=_flag_type(SETTINGS["workers"].parse), help="with --remote: compile workers (default: the CPU quota)")
    prewarm.add_argument(
        "--worker-start",
        choices=WORKER_STARTS,
        help="with --remote: how compile workers start, as for serve (default: $KERNEL_SERVICE_WORKER_START, else zygote)",
    )
    prewarm.add_argument(
        "--kernel-module", action="append", default=[], metavar="MODULE[:ATTR]", help="with --remote: also build these modules' kinds (repeatable)"
    )
    prewarm.set_defaults(run=_prewarm)

    from .provenance import SIGNING_KEY as SIGNING_KEY_NAME  # light: names only

    bundle = sub.add_parser(
        "bundle", help="pack cache entries for another host (signed, per arch, compressed), inspect such a pack, check it, or import it"
    ).add_subparsers(dest="bundle_command", required=True)
    keying = argparse.ArgumentParser(add_help=False)
    keying.add_argument("--cache-dir", help=cache_help)
    keying.add_argument("--cuda-compiler", choices=("auto", "nvrtc", "nvcc"), help="the CUDA compiler whose keys to use, as for serve (default auto)")
    keying.add_argument(
        "--cuda-compiler-id", metavar="ID", help="key CUDA kernels as if built by this compiler (e.g. nvrtc-13.0): for a host that does not compile"
    )
    keying.add_argument("--kernel-module", action="append", default=[], metavar="MODULE[:ATTR]", help="also know these modules' kinds (repeatable)")
    trusting = argparse.ArgumentParser(add_help=False)
    trusting.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="PATH",
        help="accept bundles signed by this Ed25519 public key (PEM, as `bundle key` prints it; repeatable); "
        "default: the files $KERNEL_SERVICE_TRUSTED_KEYS lists, ':'-separated",
    )
    trusting.add_argument("--trust-unsigned", action="store_true", help="also accept a bundle that no trusted key signed: only from a builder you trust")
    trusting.add_argument(
        "--target",
        metavar="ARCH",
        help="the CUDA arch this host serves (as its daemon's serve --target), for a host whose GPU nvidia-smi does not show: "
        "a CPU-only builder, an image build; default: the local GPU's, else only target c",
    )
    trusting.add_argument("--any-arch", action="store_true", help="accept kernels for arches this host cannot run")
    export = bundle.add_parser(
        "export", parents=[keying], help="pack exactly the manifest's entries, with their digests and toolchain, into one file signed by this cache's key"
    )
    export.add_argument("--manifest", required=True, metavar="FILE", help="the kernels to pack (`kernel-service manifest -o FILE`)")
    export.add_argument(
        "-o", "--output", required=True, metavar="BUNDLE", help="the bundle to write: .tar.xz/.txz xz-compressed (smallest), .tar.gz/.tgz gzip, else plain tar"
    )
    export.add_argument("--target", metavar="ARCH", help="pack only the manifest's kernels for this target (sm_90a, c, ...); default: all of them")
    export.add_argument(
        "--signing-key",
        metavar="PATH",
        help=f"sign with this Ed25519 private key (PEM, mode 0600); default: the cache's own, <cache dir>/{SIGNING_KEY_NAME}, made on first use",
    )
    export.add_argument("--no-sign", action="store_true", help="write an unsigned bundle (importers then need --trust-unsigned)")
    export.set_defaults(run=_bundle_export)
    import_ = bundle.add_parser(
        "import",
        parents=[keying, trusting],
        help="check who wrote and signed the bundle, every digest, the toolchain and the arches, then publish its entries into the cache",
    )
    import_.add_argument("bundle", metavar="BUNDLE", help="a file made by `kernel-service bundle export`, owned by you or root and writable by no one else")
    import_.add_argument(
        "--layer",
        metavar="PATH",
        help="instead, lay the entries out at PATH (new or empty) as a read-only cache layer (dirs 0555, files 0444) for `serve --cache-layer`, e.g. in an image",
    )
    import_.set_defaults(run=_bundle_import)
    verify_ = bundle.add_parser(
        "verify", parents=[keying, trusting], help="make every check import makes (signature, digests, toolchain, arches); publish nothing"
    )
    verify_.add_argument("bundle", metavar="BUNDLE", help="a file made by `kernel-service bundle export`")
    verify_.set_defaults(run=_bundle_verify)
    info_ = bundle.add_parser("info", help="list a bundle's entries and its size by kind and arch, from its index (nothing is checked)")
    info_.add_argument("bundle", metavar="BUNDLE", help="a file made by `kernel-service bundle export`")
    info_.add_argument("--json", action="store_true", help="machine-readable output")
    info_.set_defaults(run=_bundle_info)
    key_ = bundle.add_parser("key", help="print the public key bundles exported here are signed with, for importers' --trusted-key")
    key_.add_argument("--cache-dir", help=cache_help + "; its key is made on first use")
    key_.add_argument("--signing-key", metavar="PATH", help="the public half of this private key instead")
    key_.set_defaults(run=_bundle_key)

    explain = sub.add_parser(
        "explain",
        help="say whether a kernel is in the cache, what its key is made of, and for a miss which fields the nearest entries differ in; exit 1 on a miss",
    )
    explain.add_argument("kind", help="kernel kind, e.g. gemm")
    explain.add_argument("params", nargs="*", metavar="NAME=VALUE", help="parameters, e.g. N=4096 dtype=float16 M=none")
    explain.add_argument("--target", help="c, auto or a CUDA arch such as sm_90a (default: the daemon's)")
    explain.add_argument("--socket", help=socket_help)
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(run=_explain)

    flags = sub.add_parser("flags-markdown", help="print docs/cli.md: these commands, their flags and the daemon's settings, as markdown")
    flags.set_defaults(run=_flags_markdown)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # first (the parser's defaults import proto): a foreign `proto` or `kernels` is said in one line, for every command
        from proto.clashes import check

        check()
    except ImportError as exc:
        return _fail(str(exc))
    from . import logs
    from .config import resolve_setting

    args = build_parser().parse_args(argv)
    try:
        logs.configure(resolve_setting("log_level", args.log_level)[0], resolve_setting("log_format", args.log_format)[0])
    except ValueError as exc:  # a bad variable (argparse checked the flags)
        return _fail(str(exc), 2)
    try:
        return args.run(args)
    except BrokenPipeError:  # `kernel-service stats | head -1`: the reader left, as with any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


if __name__ == "__main__":
    sys.exit(main())
