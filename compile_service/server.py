"""The daemon process: one instance per socket and cache, a gRPC server, a clean drain.

Start-up: take the cache's and the socket's instance locks (a second live
daemon is refused with the holder's pid; a socket file left by a killed daemon
is removed, since its lock died with it), sweep dead writers' staging
directories, enforce the cache budget, start the compile workers, then
listen: on the Unix socket (0600, or 0660 with --mode 0750), and on TCP only
when asked (loopback unless --allow-remote), always with so_reuseport=0 so a
second process can never bind the same port and steal requests.
Shutdown (SIGTERM/SIGINT): health goes NOT_SERVING, new RPCs are refused,
running ones get `grace` seconds, then the workers are stopped. Entries are
only ever published whole, so no partial entry is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from filelock import FileLock, Timeout
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import kernels
from kernels import plugins
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import socket_address

from . import __version__, inductor
from .build import devices
from .build.compiler import DEVICE_BINARIES
from .config import ServiceConfig
from .cpus import usable_cpus
from .keys import describe_toolchain
from .metrics import Metrics
from .scheduler import Scheduler
from .servicer import KernelServicer
from .store import Budget, LocalStore

log = logging.getLogger(__name__)

SERVICE_NAME = "kernelservice.v1.KernelService"


class AlreadyRunning(RuntimeError):
    pass


def _instance_lock(path: Path, what: str) -> FileLock:
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        holder = _read_pid(path.with_suffix(".pid"))
        raise AlreadyRunning(f"another kernel-service daemon{f' (pid {holder})' if holder else ''} is already serving {what}") from None
    path.with_suffix(".pid").write_text(f"{os.getpid()}\n")
    return lock


def _read_pid(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _socket_dir(path: Path, mode: int) -> None:
    """Creates the socket's directory with `mode`; an existing one is only checked: it may be shared (/tmp)."""
    try:
        path.mkdir(mode=mode, parents=True)
        os.chmod(path, mode)
    except FileExistsError:
        st = path.stat()
        if st.st_mode & 0o022 and not st.st_mode & 0o1000:
            log.warning("socket directory %s is writable by others (mode %04o): they could replace the socket", path, st.st_mode & 0o7777)


RPC_NICE = 10


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
        self._locks: list[FileLock] = []
        self._stopped = threading.Event()
        self.server: grpc.Server | None = None
        self.health = health.HealthServicer()

    def start(self) -> None:
        cfg = self.config
        cfg.cache_dir.mkdir(mode=cfg.mode, parents=True, exist_ok=True)
        _socket_dir(cfg.socket.parent, cfg.mode)
        self._locks.append(_instance_lock(cfg.cache_dir / "daemon.lock", f"cache dir {cfg.cache_dir}"))
        try:
            self._locks.append(_instance_lock(cfg.socket.with_name(cfg.socket.name + ".lock"), f"socket {cfg.socket}"))
        except AlreadyRunning:
            self._release()
            raise
        if cfg.socket.exists() or cfg.socket.is_symlink():
            log.info("removing stale socket %s left by a daemon that is gone", cfg.socket)
            cfg.socket.unlink()

        plugins.load(**cfg.plugin_args)
        device = devices.get(cfg.cuda_compiler)
        self.metrics = Metrics()
        store = LocalStore(cfg.cache_dir, cfg.mode, metrics=self.metrics, extra_usage=(cfg.cache_dir / DEVICE_BINARIES,))
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
            options=[("grpc.so_reuseport", 0), *wire.channel_options()],
        )
        listening = f"{address} tcp:{cfg.tcp}" if cfg.tcp else address
        inductor_dir = inductor.ensure(cfg.cache_dir)
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
        if cfg.tcp:  # only on request, loopback unless --allow-remote (checked in config)
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
        try:
            self.config.socket.unlink()
        except FileNotFoundError:
            pass
        self._release()
        self._stopped.set()
        log.info("stopped")

    def _release(self) -> None:
        for lock in self._locks:
            lock.release()
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
