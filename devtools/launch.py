"""Starting a daemon as a child process and waiting until it serves.

For the demo, tests and benchmarks; production runs `kernel-service serve`
under a supervisor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.processes import alive, descendants
from proto import wire
from proto.paths import socket_address

ROOT = Path(__file__).resolve().parents[1]  # the repository: daemons run with it as cwd


def wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Blocks until the daemon's health service says SERVING; raises if `proc` exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"no healthy kernel service at {address} after {timeout:.0f}s")


def is_serving(socket: Path | str) -> bool:
    try:
        wait_serving(socket_address(socket), 1.5)
        return True
    except TimeoutError:
        return False


class DaemonProcess:
    """`kernel-service serve` in a child process, on its own socket and cache.

    Output goes to `log_path` (default: a file next to the cache). Use as a
    context manager, or call start() and stop().
    """

    def __init__(
        self,
        cache_dir: Path | str,
        *extra: str,
        socket: Path | str | None = None,
        workers: int | None = None,
        log_path: Path | None = None,
        env: dict | None = None,
    ):
        self.cache_dir = Path(cache_dir)
        self.env = env or {}  # variables set for the daemon on top of ours
        # Unix socket paths are limited to ~107 bytes: keep it short, under /tmp.
        self.socket = Path(socket) if socket else Path(tempfile.mkdtemp(prefix="ks-", dir="/tmp")) / "ks.sock"
        self.log_path = log_path or self.cache_dir.parent / f"daemon-{self.cache_dir.name}-{os.urandom(3).hex()}.log"
        # --exit-with-parent: a launcher that dies without stop() (SIGTERM, SIGKILL) leaves no daemon behind.
        self.args = [
            "serve",
            "--socket",
            str(self.socket),
            "--cache-dir",
            str(self.cache_dir),
            "--exit-with-parent",
            *(["--workers", str(workers)] if workers else []),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 300) -> DaemonProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "compile_service.cli", *self.args],
                cwd=ROOT,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if wait:
            wait_serving(socket_address(self.socket), timeout, self.proc)
        return self

    def client(self, **options):
        import client

        return client.connect(self.socket, **options)

    def wait_workers_ready(self, timeout: float = 600) -> None:
        """Blocks until every compile worker has started and warmed up (stats: workers_ready == workers)."""
        deadline = time.monotonic() + timeout
        c = self.client()
        try:
            while (stats := c.stats())["workers_ready"] < stats["workers"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{stats['workers_ready']} of {stats['workers']} workers ready after {timeout:.0f}s; see {self.log_path}")
                time.sleep(0.05)
        finally:
            c.close()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status once the daemon and every
        process below it (its zygote and workers die with it, a moment later) are gone, so that
        what runs next, a benchmark's next variant, has the machine to itself."""
        if self.proc is None:
            return None
        below = descendants(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + timeout
        while any(map(alive, below)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> DaemonProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
