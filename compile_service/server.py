"""The daemon process: one instance per socket and cache, a gRPC server, a clean drain.

Start-up, within a second: take the cache's and the socket's instance locks (a
second live daemon is refused with the holder's pid; a socket file left by a
killed daemon is removed, since its lock died with it), spawn the compile
workers (they import TileLang and warm up in the background, and die with the
daemon), then listen: on the Unix socket (0600, or 0660 with --mode 0750), and
on TCP only when asked (loopback unless --allow-remote), always with
so_reuseport=0 so a second process can never bind the same port and steal
requests; health says SERVING. Housekeeping follows in the background: dead
writers' staging directories swept, the cache budget enforced, the counters
saved every SAVE_EVERY seconds.
Shutdown (SIGTERM/SIGINT, `kernel-service stop`): health goes NOT_SERVING, new
RPCs are refused, running ones get `grace` seconds, then the workers are
stopped and the counters saved. Entries are only ever published whole, so no
partial entry is left behind.
"""

from __future__ import annotations

import json
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

from kernels import plugins
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import socket_address

from . import __version__, inductor
from .apps import AppRecorder
from .build import devices
from .build.compiler import DEVICE_BINARIES
from .config import ServiceConfig
from .cpus import usable_cpus
from .keys import describe_toolchain
from .metrics import SAVE_EVERY, STATS_FILE, Metrics
from .scheduler import Scheduler
from .servicer import KernelServicer
from .store import Budget, LocalStore

log = logging.getLogger(__name__)

SERVICE_NAME = "kernelservice.v1.KernelService"


class StartError(RuntimeError):
    """The daemon cannot start; the message names the problem and the fix."""


class AlreadyRunning(StartError):
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


def socket_lock(socket: Path) -> Path:
    """The instance lock a daemon holds for as long as it serves `socket` (its pid next to it)."""
    return socket.with_name(socket.name + ".lock")


def running_daemon(socket: Path) -> int | None:
    """The pid of the daemon serving `socket`, or None when none holds its instance lock."""
    lock = socket_lock(socket)
    if not lock.exists():
        return None
    probe = FileLock(str(lock), timeout=0)
    try:
        probe.acquire()
    except Timeout:
        pid = _read_pid(lock.with_suffix(".pid"))
        return int(pid) if pid and pid.isdigit() else -1
    except OSError:
        return None
    probe.release()
    return None


def _make_dir(path: Path, mode: int, what: str, flag: str) -> None:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise StartError(f"cannot create the {what} {path}: {exc.strerror or exc}; pass {flag} a directory you can write") from None


def _socket_dir(path: Path, mode: int) -> None:
    """Creates the socket's directory with `mode`; an existing one is only checked: it may be shared (/tmp)."""
    if not path.is_dir():
        _make_dir(path, mode, "socket's directory", "--socket a path in")
        os.chmod(path, mode)
    else:
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
    """The target whose headers NVRTC workers parse as they warm up: the default target, when
    it is CUDA (a GPU host, or a daemon told to build for one; the workers resolve "auto")."""
    return cfg.target if cfg.cuda_compiler == devices.NVRTC and cfg.warm_up and not cfg.no_compile else None


class Daemon:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self._locks: list[FileLock] = []
        self._stopped = threading.Event()
        self._serving = threading.Event()
        self.server: grpc.Server | None = None
        self.exporter = None  # the Prometheus endpoint's HTTP server, when asked for
        self.health = health.HealthServicer()

    def start(self) -> None:
        cfg = self.config
        _make_dir(cfg.cache_dir, cfg.mode, "cache directory", "--cache-dir (or $KERNEL_SERVICE_CACHE_DIR)")
        _socket_dir(cfg.socket.parent, cfg.mode)
        self._locks.append(_instance_lock(cfg.cache_dir / "daemon.lock", f"cache dir {cfg.cache_dir}"))
        try:
            self._locks.append(_instance_lock(socket_lock(cfg.socket), f"socket {cfg.socket}"))
        except AlreadyRunning:
            self._release()
            raise
        if cfg.socket.exists() or cfg.socket.is_symlink():
            log.info("removing stale socket %s left by a daemon that is gone", cfg.socket)
            cfg.socket.unlink()

        plugins.load(**cfg.plugin_args)
        device = cfg.device
        if cfg.no_compile:
            log.info("serving only (--no-compile): misses answer NOT_FOUND; CUDA keys name the compiler %s", device.id)
        self.metrics = Metrics()
        self.metrics.load(cfg.cache_dir / STATS_FILE)  # totals go on from the last daemon's
        self.store = store = LocalStore(cfg.cache_dir, cfg.mode, metrics=self.metrics, extra_usage=(cfg.cache_dir / DEVICE_BINARIES,))
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
            start=False,  # the spawner starts them once SERVING
            compiles=not cfg.no_compile,
        )
        threading.Thread(target=self._spawn_workers, name="spawner", daemon=True).start()  # at nice 0, as its workers
        # From here on this thread only starts gRPC: lowering its priority now makes
        # every thread gRPC creates inherit it (the workers are spawned at nice 0).
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
            running=lambda: self.scheduler.running,
            queued=lambda: self.scheduler.queued,
            workers=lambda: 0 if cfg.no_compile else cfg.workers,
            workers_ready=lambda: self.scheduler.workers_ready,
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
        missing = set(wire.STATS_FIELDS) - self.metrics.names()
        if missing:  # a Stats field nobody fills would read as a silent zero
            raise RuntimeError(f"no metric feeds the Stats fields {sorted(missing)}")
        info = {
            "cache_dir": str(cfg.cache_dir),
            "inductor_dir": str(inductor_dir),
            "default_target": cfg.target,
            "config_json": json.dumps(cfg.describe(), sort_keys=True),
        }
        self.servicer = KernelServicer(self.scheduler, self.metrics, info, AppRecorder(cfg.cache_dir, cfg.mode), zero_stats=self.zero_stats)
        pb_grpc.add_KernelServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(address)
        if cfg.tcp:  # only on request, loopback unless --allow-remote (checked in config)
            try:
                bound = self.server.add_insecure_port(cfg.tcp)
            except RuntimeError:
                bound = 0
            if not bound:
                raise StartError(f"cannot listen on tcp {cfg.tcp} (in use, or not an address of this host); choose another --tcp address")
        if cfg.metrics_address:
            from .exporter import serve_metrics

            try:
                self.exporter = serve_metrics(self.metrics, cfg.metrics_address)
            except OSError as exc:
                raise StartError(f"cannot serve metrics on {cfg.metrics_address}: {exc.strerror or exc}; choose another --metrics-address") from None
        self.server.start()
        os.chmod(cfg.socket, 0o660 if cfg.mode & 0o070 else 0o600)  # connecting needs write permission
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("kernel-service listening on %s, cache %s, %d workers starting", listening, cfg.cache_dir, cfg.workers)
        self._serving.set()
        threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True).start()

    def _spawn_workers(self) -> None:
        """Spawns the compile workers once the daemon says SERVING (their TileLang imports would
        slow gRPC's start on a busy machine), then stays until the daemon stops: a worker dies
        with the thread that spawned it (die_with_parent), and takes its priority (nice 0)."""
        self._serving.wait()
        if not self._stopped.is_set():
            self.scheduler.start_workers()
        self._stopped.wait()

    def _housekeeping(self) -> None:
        """After SERVING: the start-up chores that may walk a large cache, then the counters
        saved every SAVE_EVERY seconds until stop."""
        swept = self.store.clean_staging()
        if swept:
            log.info("removed %d staging directories left by dead writers", swept)
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
        log.info("draining: refusing new requests, up to %.0fs for running ones", grace)
        self.health.enter_graceful_shutdown()
        done = self.server.stop(grace) if self.server else None
        self.scheduler.shutdown(grace)
        if done is not None:
            done.wait(grace + 5)
        if self.exporter is not None:
            self.exporter.shutdown()
        self._stopped.set()
        self.metrics.save(self.config.cache_dir / STATS_FILE)
        try:
            self.config.socket.unlink()
        except FileNotFoundError:
            pass
        self._release()
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
