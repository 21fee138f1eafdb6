"""The daemon process: one instance per socket and cache, a gRPC server, a clean drain.

Start-up: refuse untrusted places (the cache root, each directory in it and
the socket's directory must be real directories owned by the daemon's uid that
no one else may write: proto/trust.py), set a umask so everything created is
owner-only (group-readable with --mode 0750), take the cache's and the
socket's instance locks (files opened without following links; a second live
daemon is refused with the holder's pid; a socket left by a killed daemon is
removed, since its lock died with it, and only if it is a socket), sweep dead
writers' staging directories, enforce the cache budget, start the compile workers, then
listen: on the Unix socket (0600, or 0660 with --mode 0750), and on TCP only
when asked (loopback unless --allow-remote, every call authenticated with the
token written to <cache root>/tcp-token), always with so_reuseport=0 so a
second process can never bind the same port and steal requests.
Shutdown (SIGTERM/SIGINT): health goes NOT_SERVING, new RPCs are refused,
running ones get `grace` seconds, then the workers are stopped. Entries are
only ever published whole, so no partial entry is left behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import secrets
import signal
import stat
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import kernels
from kernels import plugins
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import TOKEN_FILE, socket_address
from proto.trust import UntrustedPath, open_private_file, private_dir

from . import __version__, inductor
from .build import devices
from .build.compiler import DEVICE_BINARIES, device_binary_dir
from .config import ServiceConfig
from .cpus import usable_cpus
from .guard import RequestGuard
from .keys import describe_toolchain
from .metrics import Metrics
from .scheduler import Scheduler
from .servicer import KernelServicer
from .store import Budget, LocalStore

log = logging.getLogger(__name__)

SERVICE_NAME = "kernelservice.v1.KernelService"


class AlreadyRunning(RuntimeError):
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


def _write_token(path: Path) -> str:
    """A fresh random token for TCP clients, owner-only whatever --mode says, rewritten at every start."""
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
    """The CUDA arch whose headers NVRTC workers parse at start: the default target's, when
    that is CUDA (a GPU host, or a daemon told to build for one). CPU-only hosts skip it."""
    if cfg.cuda_compiler != devices.NVRTC or not cfg.warm_up:
        return None
    try:
        target = kernels.parse_target(cfg.target)
    except kernels.InvalidSpec:
        return None
    return None if target.is_cpu else target.arch


class Daemon:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self._locks: list[int] = []  # flocked descriptors
        self._stopped = threading.Event()
        self.server: grpc.Server | None = None
        self.scheduler: Scheduler | None = None
        self.health = health.HealthServicer()

    def start(self) -> None:
        cfg = self.config
        # Whatever umask we were started with, everything the daemon and its workers create
        # (lock and pid files, the socket before its chmod, TileLang's device-binary cache)
        # is owner-only, or group-readable with --mode 0750.
        os.umask(0o777 & ~cfg.mode)
        _return_large_buffers()
        cfg.cache_dir.parent.mkdir(parents=True, exist_ok=True)
        private_dir(cfg.cache_dir, cfg.mode, "cache directory", CACHE_FIX)
        _socket_dir(cfg.socket.parent, cfg.mode)
        self._locks.append(_instance_lock(cfg.cache_dir / "daemon.lock", f"cache dir {cfg.cache_dir}"))
        try:
            self._locks.append(_instance_lock(cfg.socket.with_name(cfg.socket.name + ".lock"), f"socket {cfg.socket}"))
            _remove_stale_socket(cfg.socket)
            self._start(cfg)
        except BaseException:
            self._abandon()
            raise

    def _start(self, cfg: ServiceConfig) -> None:
        plugins.load(**cfg.plugin_args)
        device = devices.get(cfg.cuda_compiler)
        self.metrics = Metrics()
        # Every directory of the cache is checked before any work: a refusal costs no compile workers.
        store = LocalStore(cfg.cache_dir, cfg.mode, metrics=self.metrics, extra_usage=(cfg.cache_dir / DEVICE_BINARIES,))
        for d in (cfg.cache_dir / DEVICE_BINARIES, device_binary_dir(cfg.cache_dir, device.id)):
            private_dir(d, cfg.mode, "cache directory", CACHE_FIX)
        inductor_dir = inductor.ensure(cfg.cache_dir)
        swept = store.clean_staging()
        if swept:
            log.info("removed %d staging directories left by dead writers", swept)
        budget = Budget(cfg.max_bytes, cfg.max_entries, cfg.evict_min_age)
        self.scheduler = Scheduler(
            store,
            cfg.workers,
            cfg.queue_limit,
            cfg.plugin_args,
            cfg.failure_ttl,
            budget,
            device,
            _warm_target(cfg),
            self.metrics,
        )
        self.scheduler.enforce_budget()  # the budget may have shrunk since the last run
        if cfg.warm_up:
            self.scheduler.warm_up()
        # From here on this thread only starts gRPC: lowering its priority now makes
        # every thread gRPC creates inherit it (the workers were spawned at nice 0).
        _yield_to_compiles()

        address = socket_address(cfg.socket)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max(64, 8 * cfg.workers), thread_name_prefix="rpc", initializer=_yield_to_compiles),
            interceptors=[RequestGuard(_write_token(cfg.cache_dir / TOKEN_FILE) if cfg.tcp else None)],
            options=[("grpc.so_reuseport", 0), *wire.channel_options()],
        )
        listening = f"{address} tcp:{cfg.tcp}" if cfg.tcp else address
        started = time.time()
        self.metrics.probes(
            in_flight=lambda: self.scheduler.in_flight,
            workers=lambda: cfg.workers,
            cpu_quota=usable_cpus,
            cache_dir=lambda: str(cfg.cache_dir),
            address=lambda: listening,
            uptime_seconds=lambda: time.time() - started,
            version=lambda: __version__,
            toolchain=lambda: describe_toolchain(device.id),
            cuda_compiler=lambda: device.id,
            inductor_dir=lambda: str(inductor_dir),
        )
        self.metrics.probe(("entries", "bytes"), store.usage)
        self.metrics.probe(("inductor_entries", "inductor_bytes"), lambda: inductor.usage(inductor_dir))
        missing = set(wire.STATS_FIELDS) - set(self.metrics.read())
        if missing:  # a Stats field nobody fills would read as a silent zero
            raise RuntimeError(f"no metric feeds the Stats fields {sorted(missing)}")
        info = {"cache_dir": str(cfg.cache_dir), "inductor_dir": str(inductor_dir), "default_target": cfg.target}
        self.servicer = KernelServicer(self.scheduler, self.metrics, info)
        pb_grpc.add_KernelServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(address)
        if cfg.tcp:  # only on request, loopback unless --allow-remote (checked in config); RequestGuard checks the token
            try:
                bound = self.server.add_insecure_port(cfg.tcp)
            except RuntimeError:
                bound = 0
            if not bound:
                raise OSError(f"cannot listen on tcp {cfg.tcp} (in use, or not an address of this host)")
        self.server.start()
        os.chmod(cfg.socket, 0o660 if cfg.mode & 0o070 else 0o600)  # connecting needs write permission
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("kernel-service listening on %s, cache %s, %d workers", listening, cfg.cache_dir, cfg.workers)

    def stop(self, grace: float | None = None) -> None:
        if self._stopped.is_set():
            return
        grace = self.config.grace if grace is None else grace
        log.info("draining: refusing new requests, up to %.0fs for running ones", grace)
        self.health.enter_graceful_shutdown()
        done = self.server.stop(grace) if self.server else None
        self.scheduler.shutdown(grace)
        if done is not None:
            done.wait(grace + 5)
        self._remove_own_files()
        self._release()
        self._stopped.set()
        log.info("stopped")

    def _remove_own_files(self) -> None:
        if _is_socket(self.config.socket):
            self.config.socket.unlink()
        if self.config.tcp:
            (self.config.cache_dir / TOKEN_FILE).unlink(missing_ok=True)

    def _abandon(self) -> None:
        """A start that failed half-way leaves no socket, no workers and no locks behind."""
        if self.server is not None:
            self.server.stop(None)
        if self.scheduler is not None:
            self.scheduler.shutdown(0)
        if len(self._locks) == 2:  # only with both instance locks were the socket and token ours
            self._remove_own_files()
        self._release()

    def _release(self) -> None:
        for fd in self._locks:
            os.close(fd)  # releases the flock
        self._locks.clear()

    def serve_forever(self) -> None:
        """Runs until SIGTERM or SIGINT, then drains."""
        stop_requested = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop_requested.set())
        self.start()
        while not stop_requested.wait(1.0):
            pass
        self.stop()
