"""Shared fixtures: real daemons (subprocesses on real Unix sockets) and clients.

`cpu_kernel(kind, **params)` asks the session's daemon for a target-"c" kernel
through the real client and returns the loaded callable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import client
from compile_service.demo import wait_serving
from compile_service.paths import socket_address

ROOT = Path(__file__).resolve().parent.parent


class DaemonProcess:
    """`kernel-service serve` in a subprocess, on its own socket and cache."""

    def __init__(self, base: Path, *extra: str, cache_dir: Path | None = None, socket: Path | None = None, workers: int = 2):
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
        self.socket = socket or Path(tempfile.mkdtemp(prefix="ks-", dir="/tmp")) / "ks.sock"
        self.cache_dir = cache_dir or base / "cache"
        self.log_path = base / f"daemon-{os.urandom(3).hex()}.log"
        self.args = ["serve", "--socket", str(self.socket), "--cache-dir", str(self.cache_dir), "--workers", str(workers), "--target", "c", *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> DaemonProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "compile_service.cli", *self.args], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if wait:
            wait_serving(socket_address(self.socket), 120, self.proc)
        return self

    def client(self, **options) -> client.Client:
        return client.connect(self.socket, **options)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()
        return self.proc.returncode if self.proc else 0

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def make_daemon(tmp_path):
    """Factory of daemons stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def make(*extra: str, start: bool = True, **options) -> DaemonProcess:
        d = DaemonProcess(tmp_path / f"d{len(started)}", *extra, **options)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    """One daemon for the whole session, for tests that only need kernels served."""
    d = DaemonProcess(tmp_path_factory.mktemp("shared-daemon")).start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def cpu_kernel(shared_daemon):
    c = shared_daemon.client()

    def get(kind, **params):
        return c.get_kernel(kind, target="c", **params)

    yield get
    c.close()
