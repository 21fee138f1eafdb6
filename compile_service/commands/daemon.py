"""The commands about the daemon itself: serve, stop, info, stats, zero-stats."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .asking import NoDaemon, ask
from .output import ago, fail, human_bytes


def resolved_config(args):
    """The configuration `serve` with these flags resolves to; a bad flag or variable is a
    failure (exit 2) before any work."""
    from ..config import SETTINGS, ServiceConfig

    try:
        return ServiceConfig.resolve(**{name: getattr(args, name) for name in SETTINGS})
    except ValueError as exc:
        raise SystemExit(fail(str(exc), 2)) from None


def serve(args) -> int:
    from kernels.plugins import KernelModuleError
    from proto.trust import UntrustedPath

    from ..server import Daemon, StartError

    config = resolved_config(args)
    try:
        Daemon(config).serve_forever(parent=os.getppid() if args.exit_with_parent else None)
    except KernelModuleError as exc:  # a bad --kernel-module, found when the daemon loads it
        return fail(str(exc), 2)
    except UntrustedPath as exc:  # says in one line what is wrong and what to do about it
        return fail(exc.strerror or str(exc))
    except (StartError, ImportError, LookupError, TypeError, RuntimeError) as exc:  # plugins included
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    return 0


def stats(args) -> int:
    from proto.channel import fields_of
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    try:
        stats = fields_of(ask(args.socket, "GetStats", pb.GetStatsRequest()))
    except ConnectionError as exc:
        return fail(str(exc))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(
        f"counters since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stats['stats_since']))} ({ago(stats['stats_since'])}; `kernel-service zero-stats` resets them):"
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
    print(f"{'bytes':>16}: {stats['bytes']} ({human_bytes(int(stats['bytes']))})")
    print(f"{'inductor':>16}: {stats['inductor_dir']} ({stats['inductor_entries']} files, {human_bytes(int(stats['inductor_bytes']))})")
    for name in ("cache_dir", "address", "version", "toolchain", "cuda_compiler"):
        print(f"{name:>16}: {stats[name]}")
    print(f"{'uptime':>16}: {stats['uptime_seconds']:.0f} s")
    if stats["remote"]:
        mode = " read-only" if stats["remote_read_only"] else ""
        print(f"{'remote':>16}: {stats['remote']} ({stats['remote_state']}{mode})")
        for name in ("remote_hits", "remote_misses", "remote_lease_waits", "remote_takeovers", "remote_errors", "remote_corrupt"):
            print(f"{name:>16}: {stats[name]}")
        print(f"{'remote_bytes':>16}: {human_bytes(int(stats['remote_bytes_in']))} in, {human_bytes(int(stats['remote_bytes_out']))} out")
    return 0


def zero_stats(args) -> int:
    from proto.channel import fields_of
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.paths import ADMIN_METADATA, ADMIN_TOKEN_FILE

    from ..metrics import STATS_FILE, Metrics
    from .cache import cache_dir_of

    try:
        # Owner-only: the call carries the admin secret the daemon wrote under its cache root.
        admin = Path(ask(args.socket, "GetServiceInfo", pb.GetServiceInfoRequest()).cache_dir) / ADMIN_TOKEN_FILE
        try:
            secret = admin.read_text().strip()
        except OSError as exc:
            return fail(f"cannot read the daemon's admin secret {admin} ({exc.strerror}): zero-stats is for the daemon's owner; run it as that user")
        before = fields_of(ask(args.socket, "ZeroStats", pb.ZeroStatsRequest(), metadata=((ADMIN_METADATA, secret),)))
        print(
            f"counters of the daemon at {before['address']} set to zero (it had {before['compiles']} compiles, {before['hits']} hits, {before['misses']} misses)"
        )
        return 0
    except NoDaemon:
        pass  # no daemon: zero the totals the next one starts from
    except ConnectionError as exc:
        return fail(str(exc))
    cache_dir = cache_dir_of(args)
    if not (cache_dir / "entries").is_dir():
        return fail(f"{cache_dir} is not a kernel cache; pass --cache-dir, or --socket of a running daemon")
    Metrics().save(cache_dir / STATS_FILE)
    print(f"no daemon running; the counters kept in {cache_dir / STATS_FILE} set to zero")
    return 0


def exited(pid: int) -> bool:
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


def stop(args) -> int:
    from proto.paths import default_socket

    from ..stopping import NotTheDaemon, terminate

    socket = Path(args.socket) if args.socket else default_socket()
    refuse = "refusing to signal it; stop the daemon as its owner, or with the supervisor that started it"
    try:
        pid = terminate(socket)
    except NotTheDaemon as exc:
        return fail(f"{exc}: {refuse}")
    except PermissionError:
        return fail(f"the daemon on {socket} belongs to another user; stop it as that user")
    if pid is None:
        print(f"no kernel-service daemon is running on {socket}")
        return 0
    deadline = time.monotonic() + args.timeout
    while not exited(pid):  # it drains, then it exits
        if time.monotonic() > deadline:
            return fail(
                f"the daemon (pid {pid}) is still draining after {args.timeout:.0f} s; wait, or `kill -9 {pid}` to stop it at once (checked: the daemon serving {socket})"
            )
        time.sleep(0.1)
    print(f"stopped the daemon on {socket} (pid {pid})")
    return 0


def info(args) -> int:
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    from ..config import SETTINGS

    config = resolved_config(args)
    try:
        reply = ask(str(config.socket), "GetServiceInfo", pb.GetServiceInfoRequest())
        settings, origin = json.loads(reply.config_json), f"the daemon running on {config.socket}"
    except NoDaemon:
        settings, origin = config.describe(), f"`kernel-service serve` with these flags (no daemon is running on {config.socket})"
    except ConnectionError as exc:
        return fail(str(exc))
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
