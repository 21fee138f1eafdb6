"""Shared fixtures: real daemons (subprocesses on real Unix sockets) and clients.

`cpu_kernel(kind, **params)` asks the session's daemon for a target-"c" kernel
through the real client and returns the loaded callable.

The session fails when any process it started outlives it (a daemon, a compile
worker orphaned by a killed daemon, a client subprocess): see `no_process_left`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from devtools.launch import DaemonProcess
from tests.processes import carrying

SESSION_MARK = "KERNEL_SERVICE_TEST_SESSION"  # inherited by every process the session starts, and theirs


@pytest.fixture(scope="session", autouse=True)
def no_process_left():
    """Fails the session, loudly, if a process it started is still alive at its end (after the
    other session fixtures stopped their daemons), and kills what it finds."""
    os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    yield
    # torch.compile's own worker pool (Triton compiles on a GPU host) lives until this process
    # exits, where torch shuts it down: shut it down now, so that only real leaks remain.
    inductor = sys.modules.get("torch._inductor.async_compile")
    if inductor is not None:
        inductor.shutdown_compile_workers()
    deadline = time.monotonic() + 10  # a daemon told to stop may take a moment to exit
    left = carrying(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = carrying(mark)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, "processes started by the test session outlived it:\n" + "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in left.items())


@pytest.fixture
def make_daemon(tmp_path):
    """Factory of daemons (target "c", 2 workers unless told) stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def make(
        *extra: str, start: bool = True, cache_dir: Path | None = None, socket: Path | None = None, workers: int = 2, env: dict | None = None
    ) -> DaemonProcess:
        base = tmp_path / f"d{len(started)}"
        d = DaemonProcess(cache_dir or base / "cache", "--target", "c", *extra, socket=socket, workers=workers, log_path=base / "daemon.log", env=env)
        started.append(d)
        return d.start(timeout=120) if start else d

    yield make
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    """One daemon for the whole session, for tests that only need kernels served."""
    base = tmp_path_factory.mktemp("shared-daemon")
    d = DaemonProcess(base / "cache", "--target", "c", workers=2, log_path=base / "daemon.log").start(timeout=120)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def cpu_kernel(shared_daemon):
    c = shared_daemon.client()

    def get(kind, **params):
        return c.get_kernel(kind, target="c", **params)

    yield get
    c.close()
