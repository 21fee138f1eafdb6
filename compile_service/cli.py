"""`kernel-service`: serve, stats, kinds, verify, demo.

Commands that ask a running daemon (stats, kinds) speak the wire contract
(proto/) directly: the daemon's package never imports the client library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _serve(args) -> int:
    from proto.trust import UntrustedPath

    from .config import ServiceConfig, parse_size
    from .server import AlreadyRunning, Daemon

    try:
        config = ServiceConfig.resolve(
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
        )
    except ValueError as exc:
        print(f"kernel-service: {exc}", file=sys.stderr)
        return 2
    try:
        Daemon(config).serve_forever()
    except (AlreadyRunning, OSError, ImportError, LookupError, TypeError, RuntimeError) as exc:  # plugins included
        # UntrustedPath (an OSError) says in one line what is wrong and what to do about it.
        print(f"kernel-service: {exc.strerror if isinstance(exc, UntrustedPath) else exc}", file=sys.stderr)
        return 1
    return 0


def _verify(args) -> int:
    from proto.paths import default_cache_dir

    from .store import LocalStore
    from .store.check import verify

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        store = LocalStore(cache_dir, create=False)
    except OSError as exc:
        print(f"kernel-service: {exc.strerror or exc}", file=sys.stderr)
        return 2
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


def _ask(socket: str | None, rpc: str, request):
    """One call to the daemon at `socket` (default: the default socket) through the contract's stubs."""
    import grpc

    from proto import wire
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
    from proto.paths import default_socket, default_token_file, socket_address

    address = socket_address(socket or default_socket())
    metadata = None
    if not address.startswith("unix:"):  # over TCP the daemon wants its token ($KERNEL_SERVICE_TOKEN_FILE)
        try:
            metadata = (("authorization", f"Bearer {default_token_file().read_text().strip()}"),)
        except OSError:
            pass  # then the daemon answers UNAUTHENTICATED, and that is what we say
    with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
        try:
            return getattr(pb_grpc.KernelServiceStub(channel), rpc)(request, timeout=10, metadata=metadata)
        except grpc.RpcError as err:
            raise ConnectionError(f"no kernel service answers at {address}: {err.code().name}: {err.details()}") from None


def _stats(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        reply = _ask(args.socket, "GetStats", pb.GetStatsRequest())
    except ConnectionError as exc:
        print(f"kernel-service: {exc}", file=sys.stderr)
        return 1
    stats = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}  # native ints, unlike MessageToDict
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    for name in ("compiles", "derived", "hits", "misses", "joined", "failures", "failures_cached", "invalid", "corrupt", "evictions", "in_flight", "workers", "cpu_quota", "entries"):
        print(f"{name:>16}: {stats[name]}")
    print(f"{'bytes':>16}: {stats['bytes']} ({_human_bytes(int(stats['bytes']))})")
    print(f"{'compile_seconds':>16}: {stats['compile_seconds']:.2f} (device code: {stats['device_compile_seconds']:.2f})")
    print(f"{'inductor':>16}: {stats['inductor_dir']} ({stats['inductor_entries']} files, {_human_bytes(int(stats['inductor_bytes']))})")
    for name in ("cache_dir", "address", "version", "toolchain", "cuda_compiler"):
        print(f"{name:>16}: {stats[name]}")
    print(f"{'uptime':>16}: {stats['uptime_seconds']:.0f} s")
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
            print(f"kernel-service: {exc}", file=sys.stderr)
            return 1
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel-service", description="TileLang kernel-compilation daemon")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon until SIGTERM")
    serve.add_argument("--socket", help="Unix socket path (default $KERNEL_SERVICE_SOCKET, then $XDG_RUNTIME_DIR/kernel-service/kernel-service.sock)")
    serve.add_argument("--cache-dir", help="cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)")
    serve.add_argument("--workers", type=int, help="compile processes (default: CPUs allowed by affinity and cgroup quota)")
    serve.add_argument("--target", default="auto", help="target for requests that name none: auto, c, sm_90a, ... (default auto)")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for running compiles (default 30)")
    serve.add_argument("--queue-limit", type=int, default=4096, help="compiles queued before RESOURCE_EXHAUSTED (default 4096)")
    serve.add_argument(
        "--kernel-module",
        action="append",
        default=[],
        metavar="MODULE[:ATTR]",
        help="import MODULE to register extra kernel kinds, or serve MODULE's kind class or @tilelang.jit factory ATTR (repeatable)",
    )
    serve.add_argument("--plugin", action="append", metavar="NAME", help="load only these installed kinds (entry-point group kernel_service.kinds; repeatable; default all)")
    serve.add_argument("--no-entry-points", action="store_true", help="load no installed kinds, only the zoo and --kernel-module")
    serve.add_argument("--failure-ttl", type=float, help="seconds a failed compile is answered from memory before it is retried (default 60; 0: never remembered)")
    serve.add_argument("--max-size", metavar="BYTES", help="cache budget: evict least recently used entries above this size (e.g. 10G; default unbounded)")
    serve.add_argument("--max-entries", type=int, help="cache budget in entries (default unbounded)")
    serve.add_argument("--evict-min-age", type=float, metavar="SECONDS", help="never evict an entry handed out this recently (default 300)")
    serve.add_argument("--mode", choices=("0700", "0750"), help="cache and socket directory mode: 0700 owner only (default), 0750 group may read and connect, never write (agents of other users then pass daemon_uid)")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (host defaults to 127.0.0.1; loopback only unless --allow-remote); clients must present the token the daemon writes to <cache dir>/tcp-token")
    serve.add_argument("--allow-remote", action="store_true", help="allow --tcp on a non-loopback address (the token is sent unencrypted: trusted networks only)")
    serve.add_argument(
        "--cuda-compiler",
        choices=("auto", "nvrtc", "nvcc"),
        help="how CUDA device code is compiled: nvrtc in process (fast), nvcc as a subprocess; auto (default, or $KERNEL_SERVICE_CUDA_COMPILER) takes NVRTC where it can run",
    )
    serve.set_defaults(run=_serve)

    verify = sub.add_parser("verify", help="check every cache entry against its manifest; exit 1 on damage left unrepaired")
    verify.add_argument("--cache-dir", help="cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)")
    verify.add_argument("--repair", action="store_true", help="remove damaged entries and dead writers' staging dirs (safe while a daemon runs)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(run=_verify)

    stats = sub.add_parser("stats", help="print the daemon's counters")
    stats.add_argument("--socket", help="Unix socket path of the daemon")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(run=_stats)

    kinds = sub.add_parser("kinds", help="list the kernel kinds the daemon serves, with each parameter's type, default and meaning")
    kinds.add_argument("--socket", help="Unix socket path of the daemon (default: the default socket; without a daemon, the kinds installed here)")
    kinds.add_argument("--kernel-module", action="append", default=[], metavar="MODULE[:ATTR]", help="with no daemon: also list these modules' kinds")
    kinds.add_argument("--json", action="store_true", help="machine-readable output")
    kinds.set_defaults(run=_kinds)

    demo = sub.add_parser("demo", help="start a daemon, ask it for a few kernels twice, run them, stop")
    demo.add_argument("--socket", help="Unix socket path (default: the daemon's default)")
    demo.add_argument("--cache-dir", help="cache root (default: the daemon's default)")
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
