"""`kernel-service`: serve, stop, info, stats, zero-stats, kinds, ls, prune, clear, verify, demo.

Commands that ask a running daemon (stats, zero-stats, kinds, info) speak the
wire contract (proto/) directly: the daemon's package never imports the client
library. Commands on the cache (ls, prune, clear, verify) read it on disk and
are safe while a daemon serves it. Every failure is one line on stderr, naming
the problem and the fix, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _fail(message: str, status: int = 1) -> int:
    print(f"kernel-service: {message}", file=sys.stderr)
    return status


def _resolve(args):
    """The configuration `serve` with these flags resolves to (ValueError: a bad flag)."""
    from .config import ServiceConfig, parse_size

    return ServiceConfig.resolve(
        socket=args.socket,
        cache_dir=args.cache_dir,
        workers=args.workers,
        target=args.target,
        grace=args.grace,
        queue_limit=args.queue_limit,
        kernel_modules=tuple(args.kernel_module),
        entry_points=not args.no_entry_points,
        plugins=tuple(args.plugin) if args.plugin else None,
        failure_ttl=args.failure_ttl,
        max_bytes=parse_size(args.max_size) if args.max_size is not None else None,
        max_entries=args.max_entries,
        evict_min_age=args.evict_min_age,
        mode=int(args.mode, 8) if args.mode is not None else None,
        tcp=args.tcp,
        allow_remote=args.allow_remote,
        cuda_compiler=args.cuda_compiler,
        metrics_address=args.metrics_address,
    )


def _serve(args) -> int:
    from .server import Daemon, StartError

    try:
        config = _resolve(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        Daemon(config).serve_forever()
    except (StartError, ImportError, LookupError, TypeError, RuntimeError) as exc:  # plugins included
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    return 0


def _verify(args) -> int:
    from .store.check import verify

    store = _open_store(args)
    cache_dir = store.root
    report = verify(store, repair=args.repair)
    if args.json:
        damage = [{"what": d.what, "path": str(d.path), "why": d.why, "repaired": d.repaired} for d in report.damage]
        print(json.dumps({"cache_dir": str(cache_dir), "entries_ok": report.entries_ok, "staging_in_use": report.staging_in_use, "damage": damage}, indent=2))
    else:
        for d in report.damage:
            print(f"{'removed' if d.repaired else 'DAMAGED'} {d.what:>7}: {d.path}: {d.why}")
        print(f"{cache_dir}: {report.entries_ok} entries ok, {len(report.damage)} damaged, {len(report.unrepaired)} left unrepaired, {report.staging_in_use} staging dirs in use")
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


def _ask(socket: str | None, rpc: str, request, timeout: float = 10):
    """One call to the daemon at `socket` (default: the default socket) through the contract's
    stubs. Raises NoDaemon at once when none answers, ConnectionError on any other failure."""
    import grpc

    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
    from proto.paths import default_socket, socket_address

    address = socket_address(socket or default_socket())
    where = address.removeprefix("unix:")
    if address.startswith("unix:") and not os.path.exists(where):
        raise NoDaemon(f"no kernel-service daemon at {where}; start one with `kernel-service serve`")
    with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
        try:
            return getattr(pb_grpc.KernelServiceStub(channel), rpc)(request, timeout=timeout)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                gone = " (its socket file is there, left by a daemon that was killed)" if address.startswith("unix:") else ""
                raise NoDaemon(f"no kernel-service daemon answers at {where}{gone}; start one with `kernel-service serve`") from None
            raise ConnectionError(f"the daemon at {where} failed: {err.code().name}: {err.details()}") from None


def _stats_dict(reply) -> dict:
    return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}  # native ints, unlike MessageToDict


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _stats(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        stats = _stats_dict(_ask(args.socket, "GetStats", pb.GetStatsRequest()))
    except ConnectionError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(f"counters since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stats['stats_since']))} ({_ago(stats['stats_since'])}; `kernel-service zero-stats` resets them):")
    for name in ("compiles", "derived", "hits", "misses", "joined", "failures", "failures_cached", "invalid", "corrupt", "evictions"):
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
    return 0


def _zero_stats(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.paths import default_cache_dir

    from .metrics import STATS_FILE, Metrics

    try:
        before = _stats_dict(_ask(args.socket, "ZeroStats", pb.ZeroStatsRequest()))
        print(f"counters of the daemon at {before['address']} set to zero (it had {before['compiles']} compiles, {before['hits']} hits, {before['misses']} misses)")
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


def _stop(args) -> int:
    import signal

    from proto.paths import default_socket

    from .server import running_daemon

    socket = Path(args.socket) if args.socket else default_socket()
    pid = running_daemon(socket)
    if pid is None:
        print(f"no kernel-service daemon is running on {socket}")
        return 0
    if pid < 0:
        return _fail(f"a daemon holds {socket}'s lock but its pid file is unreadable; stop it with your supervisor")
    try:
        os.kill(pid, signal.SIGTERM)  # the daemon drains: in-flight compiles get its --grace seconds
    except ProcessLookupError:
        return 0
    except PermissionError:
        return _fail(f"the daemon on {socket} (pid {pid}) belongs to another user; stop it as that user")
    deadline = time.monotonic() + args.timeout
    while running_daemon(socket) is not None:
        if time.monotonic() > deadline:
            return _fail(f"the daemon (pid {pid}) is still draining after {args.timeout:.0f} s; wait, or `kill -9 {pid}` to stop it at once")
        time.sleep(0.1)
    print(f"stopped the daemon on {socket} (pid {pid})")
    return 0


def _info(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

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
    for name, item in settings.items():
        print(f"  {name:<16} {json.dumps(item['value']):<40} {item['source']}")
    return 0


def _open_store(args):
    """The cache at --cache-dir (default: the daemon's default), for the commands that work on disk."""
    from proto.paths import default_cache_dir

    from .store import LocalStore

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        return LocalStore(cache_dir, create=False)
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
        params = ",".join(f"{k}={v}" for k, v in e["params"].items() if v is not None and not k.startswith(("block_", "num_", "threads")))
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
    store = _open_store(args)
    before = store.usage()
    removed = store.evict(Budget(max_bytes=max_bytes, min_age=args.min_age))
    entries, total = store.usage()
    print(f"removed {removed} least recently used entries; {store.root} now holds {entries} entries, {_human_bytes(total)} (was {_human_bytes(before[1])})")
    if total > max_bytes:
        print(f"still above {_human_bytes(max_bytes)}: the rest may have been used within --min-age {args.min_age:.0f} s (plus a minute: a daemon records a use on disk at most once a minute)")
    return 0


def _clear(args) -> int:
    from .store import Budget

    store = _open_store(args)
    before = store.usage()
    removed = store.evict(Budget(max_bytes=0, max_entries=0, min_age=float("-inf")))  # nothing is kept
    print(f"removed {removed} entries and the device binaries from {store.root} ({_human_bytes(before[1] - store.usage()[1])} freed)")
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
        if args.socket:  # a daemon was named: say it is not there rather than guess
            return _fail(str(exc))
        kinds, source = _local_kinds(args), "this installation (no daemon running)"
    if args.json:
        print(json.dumps(kinds, indent=2))
        return 0
    print(f"kernel kinds served by {source}:")
    for kind in kinds:
        print(f"\n{kind['name']}  [{kind['origin']}]\n  {kind['doc']}")
        for p in kind["params"]:
            default = "required" if p["required"] else f"default {json.dumps(p.get('default'))}"
            choices = f", one of {', '.join(map(str, p['choices']))}" if p.get("choices") else ""
            runtime = ", None: runtime size / default" if p["nullable"] else ""
            print(f"    {p['name']:<12} {p['type']:<5} {default}{choices}{runtime}  {p['doc']}")
    return 0


def _demo(args) -> int:
    from .tools.demo import run_demo

    return run_demo(args.cache_dir, args.socket)


def _config_flags(p: argparse.ArgumentParser) -> None:
    """The flags that configure a daemon: `serve` takes them, `info` shows what they resolve to."""
    p.add_argument("--socket", help="Unix socket path (default $KERNEL_SERVICE_SOCKET, then $XDG_RUNTIME_DIR/kernel-service/kernel-service.sock)")
    p.add_argument("--cache-dir", help="cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)")
    p.add_argument("--workers", type=int, help="compile processes (default: CPUs allowed by affinity and cgroup quota)")
    p.add_argument("--target", help="target for requests that name none: auto, c, sm_90a, ... (default auto)")
    p.add_argument("--grace", type=float, help="seconds SIGTERM (or `kernel-service stop`) waits for running compiles (default 30)")
    p.add_argument("--queue-limit", type=int, help="compiles queued before RESOURCE_EXHAUSTED (default 4096)")
    p.add_argument(
        "--kernel-module",
        action="append",
        default=[],
        metavar="MODULE[:ATTR]",
        help="import MODULE to register extra kernel kinds, or serve MODULE's kind class or @tilelang.jit factory ATTR (repeatable)",
    )
    p.add_argument("--plugin", action="append", metavar="NAME", help="load only these installed kinds (entry-point group kernel_service.kinds; repeatable; default all)")
    p.add_argument("--no-entry-points", action="store_true", help="load no installed kinds, only the zoo and --kernel-module")
    p.add_argument("--failure-ttl", type=float, help="seconds a failed compile is answered from memory before it is retried (default 60; 0: never remembered)")
    p.add_argument("--max-size", metavar="BYTES", help="cache budget: evict least recently used entries above this size (e.g. 10G; default unbounded)")
    p.add_argument("--max-entries", type=int, help="cache budget in entries (default unbounded)")
    p.add_argument("--evict-min-age", type=float, metavar="SECONDS", help="never evict an entry used this recently (default 300)")
    p.add_argument("--mode", choices=("0700", "0750"), help="cache and socket directory mode: 0700 owner only (default), 0750 group may read and connect, never write")
    p.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (host defaults to 127.0.0.1; loopback only unless --allow-remote)")
    p.add_argument("--metrics-address", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics (host defaults to 127.0.0.1; loopback only unless --allow-remote; default off)")
    p.add_argument("--allow-remote", action="store_true", help="allow --tcp and --metrics-address on a non-loopback address (no authentication: trusted networks only)")
    p.add_argument(
        "--cuda-compiler",
        choices=("auto", "nvrtc", "nvcc"),
        help="how CUDA device code is compiled: nvrtc in process (fast), nvcc as a subprocess; auto (default, or $KERNEL_SERVICE_CUDA_COMPILER) takes NVRTC where it can run",
    )


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; use one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="kernel-service", description="TileLang kernel-compilation daemon")
    parser.add_argument("--version", action="version", version=f"kernel-service {__version__}")
    parser.add_argument("--log-level", default="INFO", type=_log_level, help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    cache_help = "cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)"
    socket_help = "Unix socket path of the daemon (default $KERNEL_SERVICE_SOCKET, then the XDG path)"

    serve = sub.add_parser("serve", help="run the daemon until SIGTERM or `kernel-service stop`")
    _config_flags(serve)
    serve.set_defaults(run=_serve)

    stop = sub.add_parser("stop", help="stop the daemon gracefully: it refuses new requests and lets running compiles finish (its --grace)")
    stop.add_argument("--socket", help=socket_help)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to exit (default 60); exit 1 if it has not")
    stop.set_defaults(run=_stop)

    info = sub.add_parser("info", help="the resolved configuration and where each value came from: the running daemon's, else what `serve` with these flags would use")
    _config_flags(info)
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
    prune.add_argument("--max-size", required=True, metavar="SIZE", help="the size to fit in: bytes, or 512M, 10G")
    prune.add_argument("--min-age", type=float, default=300.0, metavar="SECONDS", help="keep entries used this recently, whatever the size (default 300, as serve --evict-min-age)")
    prune.add_argument("--cache-dir", help=cache_help)
    prune.set_defaults(run=_prune)

    clear = sub.add_parser("clear", help="remove every entry and device binary from the cache (torch.compile's directory is left alone); safe while a daemon serves it")
    clear.add_argument("--cache-dir", help=cache_help)
    clear.set_defaults(run=_clear)

    verify = sub.add_parser("verify", help="check every cache entry against its manifest; exit 1 on damage left unrepaired")
    verify.add_argument("--cache-dir", help=cache_help)
    verify.add_argument("--repair", action="store_true", help="remove damaged entries and dead writers' staging dirs (safe while a daemon runs)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(run=_verify)

    demo = sub.add_parser("demo", help="start a daemon, ask it for a few kernels twice, run them, stop")
    demo.add_argument("--socket", help="Unix socket path (default: the daemon's default)")
    demo.add_argument("--cache-dir", help="cache root (default: the daemon's default)")
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except BrokenPipeError:  # `kernel-service stats | head -1`: the reader left, as with any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


if __name__ == "__main__":
    sys.exit(main())
