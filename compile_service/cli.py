"""`kernel-service`: serve, stats, verify, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _serve(args) -> int:
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
    except (AlreadyRunning, OSError) as exc:
        print(f"kernel-service: {exc}", file=sys.stderr)
        return 1
    return 0


def _verify(args) -> int:
    from .config import ServiceConfig
    from .store import Store

    cache_dir = ServiceConfig.resolve(cache_dir=args.cache_dir).cache_dir
    try:
        store = Store(cache_dir, create=False)
    except OSError as exc:
        print(f"kernel-service: {exc.strerror or exc}", file=sys.stderr)
        return 2
    report = store.verify(repair=args.repair)
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


def _stats(args) -> int:
    import client

    try:
        stats = client.connect(args.socket).stats()
    except client.ServiceUnavailable as exc:
        print(f"kernel-service: {exc}", file=sys.stderr)
        return 1
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


def _demo(args) -> int:
    from .demo import run_demo

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
    serve.add_argument("--kernel-module", action="append", default=[], metavar="MODULE", help="import MODULE to register extra kernel kinds (repeatable)")
    serve.add_argument("--failure-ttl", type=float, help="seconds a failed compile is answered from memory before it is retried (default 60; 0: never remembered)")
    serve.add_argument("--max-size", metavar="BYTES", help="cache budget: evict least recently used entries above this size (e.g. 10G; default unbounded)")
    serve.add_argument("--max-entries", type=int, help="cache budget in entries (default unbounded)")
    serve.add_argument("--evict-min-age", type=float, metavar="SECONDS", help="never evict an entry handed out this recently (default 300)")
    serve.add_argument("--mode", choices=("0700", "0750"), help="cache and socket directory mode: 0700 owner only (default), 0750 group may read and connect, never write")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (host defaults to 127.0.0.1; loopback only unless --allow-remote)")
    serve.add_argument("--allow-remote", action="store_true", help="allow --tcp on a non-loopback address (no authentication: trusted networks only)")
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

    demo = sub.add_parser("demo", help="start a daemon, ask it for a few kernels twice, run them, stop")
    demo.add_argument("--socket", help="Unix socket path (default: the daemon's default)")
    demo.add_argument("--cache-dir", help="cache root (default: the daemon's default)")
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
