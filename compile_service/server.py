"""The daemon process: one instance per socket and cache, a gRPC server, a clean drain.

Start-up, within a second: refuse untrusted places (the cache root, each
directory in it and the socket's directory must be real directories owned by
the daemon's uid that no one else may write: proto/trust.py), set a umask so
everything created is owner-only (group-readable with --mode 0750), take the
cache's and the socket's instance locks (files opened without following links;
a second live daemon is refused with the holder's pid; a socket left by a
killed daemon is removed, since its lock died with it, and only if it is a
socket), start the compile workers' zygote (it imports TileLang once while the
daemon starts; the workers fork from it once SERVING, warm up in the background,
and die with the daemon), then listen: on the Unix socket (0600,
or 0660 with --mode 0750), and on TCP only when asked (loopback unless
--allow-remote, every call authenticated with the token written to
<cache root>/tcp-token, over TLS with --tls-cert and --tls-key), always
with so_reuseport=0 so a second process can never bind the same port and
steal requests; health says SERVING, and a supervisor that set NOTIFY_SOCKET
is told READY=1 (STOPPING=1 when it drains).
Housekeeping follows in the background: dead writers' staging directories
swept, the cache budget enforced, the counters saved every SAVE_EVERY seconds.
Shutdown (SIGTERM/SIGINT, `kernel-service stop`, or with --exit-with-parent its
launcher's exit): health goes NOT_SERVING, new
RPCs are refused, running ones get `grace` seconds, then the workers are
stopped and the counters saved. Entries are only ever published whole, so no
partial entry is left behind.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import logging
import os
import secrets
import signal
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kernels import plugins
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import ADMIN_TOKEN_FILE, TOKEN_FILE, service_info_file, socket_address
from proto.trust import UntrustedPath, open_private_file, private_dir

from . import __version__, inductor
from .apps import AppRecorder
from .build import devices
from .build.compiler import DEVICE_BINARIES, device_binary_dir
from .config import MAX_SOCKET_PATH, ServiceConfig
from .cpus import usable_cpus
from .fsutil import remove_tree, write_text_atomic
from .guard import RequestGuard
from .keys import describe_toolchain
from .layout import counted_dirs
from .memory import BuildMemory, describe_limit
from .metrics import SAVE_EVERY, STATS_FILE, Metrics
from .notify import notify
from .scheduler import Scheduler
from .servicer import MAX_WAITING, KernelServicer
from .store import Budget, LocalStore
from .store.layers import Layer, Layered, is_layer
from .workers import process_pool

log = logging.getLogger(__name__)

SERVICE_NAME = "kernelservice.v1.KernelService"
# The health of the metrics endpoint, apart from the daemon's own: with --metrics-address,
# SERVING while /metrics serves, NOT_SERVING when it could not listen (the daemon serves on).
METRICS_HEALTH = "kernelservice.v1.Metrics"
# Concurrent calls on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): past it gRPC
# refuses a stream UNAVAILABLE (before the client has the setting) or holds it at the client,
# so it must never be what a burst meets first. Room for every call that may wait
# (MAX_WAITING, then BUSY) and as many again answered at once (BUSY, hits, health): channels
# of one client process share one connection, and the waiting cap governs.
MAX_STREAMS_PER_CONNECTION = 2 * MAX_WAITING
# On TCP, what a caller may send before RequestGuard refuses it is what HTTP/2 flow control
# lets in: the initial 64 KiB window per call, never grown (BDP probing off; requests are
# small, replies flow on the client's window). With probing, a 15 MB flood of unauthenticated
# requests was buffered by the hundred MB.
UNAUTHENTICATED_BYTES = [("grpc.http2.bdp_probe", 0)]


class StartError(RuntimeError):
    """The daemon cannot start; the message names the problem and the fix."""


def _check_can_listen(address: str) -> None:
    """Raises StartError when `address` (HOST:PORT or [V6]:PORT, as config checked it) cannot be
    listened on: asked before any work and before gRPC, which would log its own error for it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener: a port in TIME_WAIT is free
            probe.bind((host, int(port)))
    except OSError as exc:
        raise StartError(f"cannot listen on tcp {address} ({exc.strerror or exc}); choose another --tcp address") from None


def _tls_credentials(cfg: ServiceConfig) -> grpc.ServerCredentials:
    """gRPC's own TLS for the TCP listener, from --tls-cert and --tls-key (config checked both)."""
    try:
        return grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])
    except OSError as exc:
        raise StartError(f"cannot read {exc.filename} ({exc.strerror}); give --tls-cert and --tls-key files the daemon's user can read") from None


class AlreadyRunning(StartError):
    pass


def _instance_lock(path: Path, what: str) -> int:
    """An exclusive flock on `path`, held until the descriptor is closed; the holder's pid goes
    to the .pid file next to it. Both are opened without following links (proto/trust.py)."""
    fd = open_private_file(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _read_pid(path.with_suffix(".pid"))
        raise AlreadyRunning(f"another kernel-service daemon{f' (pid {holder})' if holder else ''} is already serving {what}") from None
    try:
        pid_fd = open_private_file(path.with_suffix(".pid"), os.O_WRONLY)
        try:
            os.ftruncate(pid_fd, 0)
            os.write(pid_fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(pid_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_pid(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text if text.isdigit() else None


CACHE_FIX = "remove it, or pass --cache-dir (or set $KERNEL_SERVICE_CACHE_DIR) to a path in a directory you own, and let kernel-service create it"
SOCKET_FIX = "remove it, or pass --socket (or set $XDG_RUNTIME_DIR) to a path in a directory you own that others cannot write"


def socket_lock(socket: Path) -> Path:
    """The instance lock a daemon holds for as long as it serves `socket` (its pid next to it)."""
    return socket.with_name(socket.name + ".lock")


# What multiprocessing adds below a temporary directory for the zygote's Unix socket:
# "/pymp-XXXXXXXX/listener-XXXXXXXX".
_LISTENER_SUFFIX = 32


def _own_temp_dir(socket: Path) -> None:
    """Points this process's temporary files (multiprocessing's pymp-* directory, with the zygote's
    socket) into <socket>.tmp, made afresh at each start, so that what a daemon killed with -9
    left there goes with the next daemon on the socket. Next to the socket, whose path is short,
    as a Unix socket's must be; a socket path too long for that keeps the default."""
    own = socket.with_name(socket.name + ".tmp")
    if len(os.fsencode(own)) + _LISTENER_SUFFIX > MAX_SOCKET_PATH:
        return
    remove_tree(own)
    own.mkdir(mode=0o700)
    tempfile.tempdir = str(own)


def _make_dir(path: Path, mode: int, what: str, flag: str, wanted: Path | None = None) -> None:
    """Creates `path` (for `wanted`, when it is a parent of what is wanted), or says in one line why not."""
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        what, path = (what.removesuffix("'s parent"), wanted) if wanted else (what, path)
        raise StartError(f"cannot create the {what} {path}: {exc.strerror or exc}; pass {flag} a directory you can write") from None


def _socket_dir(path: Path, mode: int) -> None:
    """Creates the socket's directory with `mode`. One that exists must be a real directory
    owned by us that others cannot write (else they could move the socket aside and bind
    their own server in its place); it is not chmodded (it may be a home directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    private_dir(path, mode, "socket directory", SOCKET_FIX, chmod=False)


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _remove_stale_socket(path: Path) -> None:
    """Unlinks a socket left by a daemon that is gone (we hold the instance lock it held);
    anything else at that path is not ours to delete."""
    if _is_socket(path):
        log.info("removing stale socket %s left by a daemon that is gone", path)
        path.unlink()
    elif os.path.lexists(path):
        raise UntrustedPath(errno.EEXIST, f"{path} exists and is not a socket; refusing to remove it (move it away, or pass another --socket)")


def _write_secret(path: Path) -> str:
    """A fresh random secret (the TCP token, the admin secret), owner-only whatever --mode says,
    rewritten at every start."""
    token = secrets.token_hex(32)
    fd = open_private_file(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)
    return token


RPC_NICE = 10
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_large_buffers() -> None:
    """Every allocation of 1 MiB or more gets its own mapping, unmapped when freed.

    glibc otherwise raises its mmap threshold to the size of the largest block freed, so
    after one 10 MB request each RPC thread's arena keeps 10 MB blocks for reuse: 200
    requests near the 16 MiB message limit grew the daemon by ~80 MB that never went
    back. A fixed threshold bounds what requests leave behind to what is live.
    """
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def _yield_to_compiles() -> None:
    """Lowers the calling thread's scheduling priority (Linux nice is per thread, and
    threads inherit it from the thread that creates them).

    When the CPUs are saturated, compile workers (nice 0) then get about ten times
    an RPC thread's share, so a flood of cache hits cannot slow a cold build down;
    with idle CPUs, hits run as fast as before. Lowering one's own priority needs
    no privilege.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RPC_NICE)
    except (AttributeError, OSError):  # not Linux: keep the default priority
        pass


def _warm_target(cfg: ServiceConfig) -> str | None:
    """The target whose headers NVRTC workers parse as they warm up: the default target, when
    it is CUDA (a GPU host, or a daemon told to build for one; the workers resolve "auto")."""
    return cfg.target if cfg.cuda_compiler == devices.NVRTC and not cfg.no_compile else None


def _fleet_tier(local: LocalStore, cfg: ServiceConfig, metrics: Metrics):
    """The fleet tier when --remote names one, made the local store's claims and publish hook
    (Redis is imported only then); else None."""
    if not cfg.remote:
        return None
    from .store.remote import RedisTier
    from .store.tiered import with_fleet_tier

    tier = RedisTier(
        cfg.remote, read_only=cfg.remote_read_only, lease_seconds=cfg.remote_lease_seconds, timeout=cfg.remote_timeout, ttl=cfg.remote_ttl, metrics=metrics
    )
    log.info("fleet tier %s%s, leases of %.0fs", tier.url, " (read-only)" if tier.read_only else "", cfg.remote_lease_seconds)
    with_fleet_tier(local, tier, metrics)
    return tier


@dataclass(frozen=True)
class Assembly:
    """What serves kernels: the local store (the fleet tier's hooks on it), the store the
    scheduler reads (with the read-only layers), the fleet tier (None without --remote), the scheduler."""

    local: LocalStore
    store: LocalStore | Layered
    tier: object | None  # store.remote.RedisTier, imported only with --remote
    scheduler: Scheduler


def assemble(cfg: ServiceConfig, device: devices.DeviceCompiler, metrics: Metrics, early_workers: bool = True) -> Assembly:
    """The stores and scheduler of a daemon with `cfg`, its workers not started (start_workers):
    the daemon's, and `prewarm --remote`'s, which builds as a daemon would. `early_workers`: the
    zygote starts importing TileLang now (else with the first worker: a caller that may build
    nothing). Every directory of the cache is checked before any work: a refusal costs no workers."""
    local = LocalStore(cfg.cache_dir, cfg.mode, metrics=metrics, extra_usage=counted_dirs(cfg.cache_dir))
    layers = [Layer(path, metrics) for path in cfg.cache_layers]  # refused here, as the cache root is
    if layers:
        log.info("read-only cache layers, searched after the cache: %s", ", ".join(str(layer.root) for layer in layers))
    tier = _fleet_tier(local, cfg, metrics)
    store = Layered(local, layers) if layers else local
    for d in (cfg.cache_dir / DEVICE_BINARIES, device_binary_dir(cfg.cache_dir, device.id)):
        private_dir(d, cfg.mode, "cache directory", CACHE_FIX)
    scheduler = Scheduler(
        store,
        local.claims,  # the fleet tier's, when there is one
        cfg.workers,
        cfg.queue_limit,
        cfg.plugin_args,
        cfg.failure_ttl,
        Budget(cfg.max_bytes, cfg.max_entries, cfg.evict_min_age),
        device,
        _warm_target(cfg),
        metrics,
        start=False,  # the caller starts them: the daemon once SERVING, prewarm when it has something to build
        compiles=not cfg.no_compile,
        compile_timeout=cfg.compile_timeout or None,
        memory=BuildMemory(cfg.memory_limit),
        pool=functools.partial(process_pool, start=cfg.worker_start, early=early_workers),
    )
    return Assembly(local, store, tier, scheduler)


class Daemon:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self._locks: list[int] = []  # flocked descriptors
        self._stopped = threading.Event()
        self._serving = threading.Event()
        # gRPC runs on one asyncio event loop in a thread of its own: a call holds no thread.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.servers: list[grpc.aio.Server] = []  # the Unix socket's, then TCP's: each with its own guard
        self.exporter = None  # the Prometheus endpoint's server, when asked for
        self.scheduler: Scheduler | None = None
        self.servicer: KernelServicer | None = None
        self.health = None  # health.aio.HealthServicer, made on the loop

    def start(self) -> None:
        cfg = self.config
        # Whatever umask we were started with, everything the daemon and its workers create
        # (lock and pid files, the socket before its chmod, TileLang's device-binary cache)
        # is owner-only, or group-readable with --mode 0750.
        os.umask(0o777 & ~cfg.mode)
        _return_large_buffers()
        _make_dir(cfg.cache_dir.parent, 0o777, "cache directory's parent", "--cache-dir (or $KERNEL_SERVICE_CACHE_DIR)", cfg.cache_dir)
        if is_layer(cfg.cache_dir):  # checked before private_dir, whose chmod would make it writable
            raise StartError(
                f"cache directory {cfg.cache_dir} is a read-only cache layer (its owner may not write it): serve it with --cache-layer, and give --cache-dir a writable one"
            )
        private_dir(cfg.cache_dir, cfg.mode, "cache directory", CACHE_FIX)
        _socket_dir(cfg.socket.parent, cfg.mode)
        self._locks.append(_instance_lock(cfg.cache_dir / "daemon.lock", f"cache dir {cfg.cache_dir}"))
        try:
            self._locks.append(_instance_lock(socket_lock(cfg.socket), f"socket {cfg.socket}"))
            _remove_stale_socket(cfg.socket)
            _own_temp_dir(cfg.socket)  # before the zygote starts
            self._start(cfg)
        except BaseException:
            self._abandon()
            raise

    def _start(self, cfg: ServiceConfig) -> None:
        if cfg.tcp:
            _check_can_listen(cfg.tcp)
        plugins.load(**cfg.plugin_args)
        device = cfg.device
        if cfg.no_compile:
            log.info("serving only (--no-compile): misses answer NOT_FOUND; CUDA keys name the compiler %s", device.id)
        self.metrics = Metrics()
        self.metrics.load(cfg.cache_dir / STATS_FILE)  # totals go on from the last daemon's
        built = assemble(cfg, device, self.metrics)
        self.local, self.store, tier, self.scheduler = built.local, built.store, built.tier, built.scheduler
        store = self.store
        inductor_dir = inductor.ensure(cfg.cache_dir)
        threading.Thread(target=self._spawn_workers, name="spawner", daemon=True).start()  # at nice 0, as its workers
        # From here on this thread only starts gRPC: lowering its priority now makes
        # every thread gRPC creates inherit it (the workers are spawned at nice 0).
        _yield_to_compiles()

        address = socket_address(cfg.socket)
        listening = f"{address} tcp:{cfg.tcp}{' (TLS)' if cfg.tls_cert else ''}" if cfg.tcp else address
        started = time.time()
        self.metrics.probes(
            in_flight=lambda: self.scheduler.in_flight,
            running=lambda: self.scheduler.running,
            queued=lambda: self.scheduler.queued,
            workers=lambda: 0 if cfg.no_compile else cfg.workers,
            workers_ready=lambda: self.scheduler.workers_ready,
            cpu_quota=usable_cpus,
            memory_limit=lambda: cfg.memory_limit or 0,
            memory_builds=lambda: 0 if cfg.no_compile else self.scheduler.memory.builds_at_once(cfg.workers),
            most_builds_running=lambda: self.scheduler.memory.most_running,
            build_peak_bytes=self.scheduler.memory.largest_peak,
            cache_dir=lambda: str(cfg.cache_dir),
            address=lambda: listening,
            uptime_seconds=lambda: time.time() - started,
            version=lambda: __version__,
            toolchain=lambda: describe_toolchain(device.id),
            cuda_compiler=lambda: device.id,
            inductor_dir=lambda: str(inductor_dir),
        )
        self.metrics.probes(
            remote=lambda: tier.url if tier else "",
            remote_state=lambda: tier.state if tier else "off",
            remote_read_only=lambda: bool(tier and tier.read_only),
        )
        self.metrics.probe(("entries", "bytes"), store.usage)
        self.metrics.probe(("inductor_entries", "inductor_bytes"), lambda: inductor.usage(inductor_dir))
        missing = set(wire.STATS_FIELDS) - self.metrics.names()
        if missing:  # a Stats field nobody fills would read as a silent zero
            raise RuntimeError(f"no metric feeds the Stats fields {sorted(missing)}")
        info = {
            "cache_dir": str(cfg.cache_dir),
            "cache_layers": [str(path) for path in cfg.cache_layers],
            "inductor_dir": str(inductor_dir),
            "default_target": cfg.target,
            "config_json": json.dumps(cfg.describe(), sort_keys=True),
        }
        self.servicer = KernelServicer(self.scheduler, self.metrics, info, AppRecorder(cfg.cache_dir, cfg.mode), zero_stats=self.zero_stats)
        token = _write_secret(cfg.cache_dir / TOKEN_FILE) if cfg.tcp else None
        admin = _write_secret(cfg.cache_dir / ADMIN_TOKEN_FILE)
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="rpc-loop", daemon=True)  # at nice RPC_NICE, as this thread
        self._loop_thread.start()
        self._on_loop(self._listen(cfg, token, admin))
        os.chmod(cfg.socket, 0o660 if cfg.mode & 0o070 else 0o600)  # connecting needs write permission
        self._on_loop(self._set_health(health_pb2.HealthCheckResponse.SERVING))
        pool = (
            "no compile workers (--no-compile)"
            if cfg.no_compile
            else f"{cfg.workers} workers starting, {describe_limit(cfg.memory_limit, cfg.sources.get('memory_limit', ''), cfg.workers)}"
        )
        log.info("kernel-service listening on %s, cache %s, %s", listening, cfg.cache_dir, pool)
        self._serving.set()
        notify("READY=1")  # systemd's Type=notify: the socket answers from now on
        threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True).start()

    def _on_loop(self, coroutine, timeout: float | None = 60):
        """Runs `coroutine` on the gRPC loop and returns its result (this thread waits)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _listen(self, cfg: ServiceConfig, token: str | None, admin: str) -> None:
        """Starts the gRPC servers: the Unix socket's, and TCP's when asked (loopback unless
        --allow-remote, checked in config), each behind its own RequestGuard (TCP's checks the
        token); then the metrics endpoint, when asked."""
        self.health = health.aio.HealthServicer()
        options = [("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION), *wire.channel_options()]

        def server(guard: RequestGuard, more: list = ()) -> grpc.aio.Server:
            made = grpc.aio.server(interceptors=[guard], options=[*options, *more])
            pb_grpc.add_KernelServiceServicer_to_server(self.servicer, made)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, made)
            self.servers.append(made)
            return made

        server(RequestGuard(None, admin)).add_insecure_port(socket_address(cfg.socket))
        if cfg.tcp:
            tcp = server(RequestGuard(token, admin), UNAUTHENTICATED_BYTES)
            try:
                bound = tcp.add_secure_port(cfg.tcp, _tls_credentials(cfg)) if cfg.tls_cert else tcp.add_insecure_port(cfg.tcp)
            except RuntimeError:
                bound = 0
            if not bound:
                raise StartError(f"cannot listen on tcp {cfg.tcp} (in use, or not an address of this host); choose another --tcp address")
        if cfg.metrics_address:
            from .exporter import serve_metrics

            # Metrics are optional, and any user of the host may take a port first: serve without them.
            try:
                self.exporter = await serve_metrics(self.metrics, cfg.metrics_address)
            except OSError as exc:
                log.warning(
                    "NOT SERVING METRICS: cannot listen on --metrics-address %s (%s); the daemon serves without them, "
                    "and health service %s says NOT_SERVING. Free the port or choose another, then restart the daemon",
                    cfg.metrics_address,
                    exc.strerror or exc,
                    METRICS_HEALTH,
                )
        for started in self.servers:
            await started.start()

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        if self.config.metrics_address:
            await self.health.set(METRICS_HEALTH, status if self.exporter is not None else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _drain(self, grace: float | None) -> None:
        """Health NOT_SERVING, new calls refused, running ones given `grace` seconds."""
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await asyncio.gather(*(server.stop(grace) for server in self.servers))

    async def _close_loop_services(self) -> None:
        if self.exporter is not None:
            await self.exporter.close()

    def _stop_loop(self) -> None:
        """Closes what runs on the loop (the metrics endpoint and its connections), then the loop."""
        if self.loop is None:
            return
        with contextlib.suppress(Exception):  # a stop must go on, whatever the loop left
            self._on_loop(self._close_loop_services(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(10)
        if self.servicer is not None:
            self.servicer.close()

    def _spawn_workers(self) -> None:
        """Starts the compile workers once the daemon says SERVING (the first fork waits for the
        zygote's TileLang import; spawned workers would each import it, slowing gRPC's start on a
        busy machine), then stays until the daemon stops: a spawned worker dies with the thread
        that started it (die_with_parent), and takes its priority (nice 0)."""
        self._serving.wait()
        if not self._stopped.is_set():
            self.scheduler.start_workers()
        self._stopped.wait()

    def _housekeeping(self) -> None:
        """After SERVING: the start-up chores that may walk a large cache, then the counters
        saved every SAVE_EVERY seconds until stop."""
        swept = self.local.clean_staging()
        if swept:
            log.info("removed %d staging directories left by dead writers", swept)
        # Built now, so that an agent's first GetServiceInfo finds it; and left in the cache root,
        # where agents that find no daemon read it to load the kernels the cache holds.
        info = {f.name: list(v) if f.is_repeated else v for f in self.servicer.info.DESCRIPTOR.fields for v in [getattr(self.servicer.info, f.name)]}
        try:
            write_text_atomic(service_info_file(self.config.cache_dir), json.dumps(info, sort_keys=True), mode=self.config.mode & 0o640)
        except OSError as exc:
            log.warning("could not leave the service info in the cache root (agents then need a daemon for every kernel): %s", exc)
        self.scheduler.enforce_budget()  # the budget may have shrunk since the last run
        while not self._stopped.wait(SAVE_EVERY):
            self.metrics.save(self.config.cache_dir / STATS_FILE)

    def zero_stats(self) -> None:
        self.metrics.zero()
        self.metrics.save(self.config.cache_dir / STATS_FILE)

    def stop(self, grace: float | None = None) -> None:
        if self._stopped.is_set():
            return
        grace = self.config.grace if grace is None else grace
        notify("STOPPING=1")
        log.info("draining: refusing new requests, up to %.0fs for running ones", grace)
        drained = asyncio.run_coroutine_threadsafe(self._drain(grace), self.loop)  # while the scheduler drains too
        self.scheduler.shutdown(grace)
        self.store.close()  # its claims: the fleet tier's queued uploads (bounded), our leases
        with contextlib.suppress(Exception):
            drained.result(grace + 5)
        self._stop_loop()
        self._stopped.set()
        self.metrics.save(self.config.cache_dir / STATS_FILE)
        self._remove_own_files()
        self._release()
        log.info("stopped")

    def _remove_own_files(self) -> None:
        if _is_socket(self.config.socket):
            self.config.socket.unlink()
        if self.config.tcp:
            (self.config.cache_dir / TOKEN_FILE).unlink(missing_ok=True)
        (self.config.cache_dir / ADMIN_TOKEN_FILE).unlink(missing_ok=True)

    def _abandon(self) -> None:
        """A start that failed half-way leaves no socket, no workers and no locks behind."""
        self._stopped.set()  # the spawner gives up
        if self.loop is not None:
            with contextlib.suppress(Exception):
                self._on_loop(self._drain(None), timeout=10)
            self._stop_loop()
        if self.scheduler is not None:  # it never ran a compile (workers start once SERVING): it stops at once
            self.scheduler.shutdown(5.0)
        if len(self._locks) == 2:  # only with both instance locks were the socket and token ours
            self._remove_own_files()
        self._release()

    def _release(self) -> None:
        for fd in self._locks:
            os.close(fd)  # releases the flock
        self._locks.clear()

    def serve_forever(self, parent: int | None = None) -> None:
        """Runs until SIGTERM or SIGINT, then drains; with `parent` (a pid), also once that
        process is gone (this one is then re-parented), checked every second."""
        stop_requested = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop_requested.set())
        self.start()
        while not stop_requested.wait(1.0):
            if parent is not None and os.getppid() != parent:
                log.info("the process that started this daemon (pid %d) is gone: stopping", parent)
                break
        self.stop()
