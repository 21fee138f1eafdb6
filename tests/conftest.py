"""Shared fixtures: real daemons (subprocesses on real Unix sockets) and clients.

`cpu_kernel(kind, **params)` asks the session's daemon for a target-"c" kernel
through the real client and returns the loaded callable.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from compile_service.tools.launch import DaemonProcess


@pytest.fixture
def make_daemon(tmp_path):
    """Factory of daemons (target "c", 2 workers unless told) stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def make(*extra: str, start: bool = True, cache_dir: Path | None = None, socket: Path | None = None, workers: int = 2, env: dict | None = None) -> DaemonProcess:
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
