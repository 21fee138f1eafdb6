"""Direct hits (kernels a client found in the cache itself, with no GetKernel) reported to the daemon.

The hit path only appends to the client's deque (thread-safe in CPython without a lock of
ours) and, at the first direct hit of the process, starts one reporter thread. The reporter
sends each client's count in one ReportUsage every FLUSH_SECONDS while there are any, and
at exit; Client.close() sends its own. So the daemon's `hits` include a direct hit within
about FLUSH_SECONDS, or as soon as its process closes the client or exits. A count the
daemon did not take (down, restarting) waits for the next report; what a process holds when
it is killed with SIGKILL, or when its daemon is down at its exit, is never counted.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

FLUSH_SECONDS = 10.0
REPORT_TIMEOUT = 2.0  # seconds one report may wait: at most what a hung daemon adds to a process's exit

_clients: weakref.WeakSet = weakref.WeakSet()  # every client of this process that may hold unreported hits
_reporter: threading.Thread | None = None
_start_lock = threading.Lock()  # taken once per process, by the first direct hit


def watch(client) -> None:
    """Registers a client (at its creation) whose direct hits the reporter sends."""
    _clients.add(client)


def count(client) -> None:
    """One direct hit of `client`: no RPC, and no lock after the process's first."""
    client._unreported_hits.append(None)
    if _reporter is None:
        _start()


def report_all() -> None:
    for client in list(_clients):
        client.report_hits()


def _start() -> None:
    global _reporter
    with _start_lock:
        if _reporter is None:
            _reporter = threading.Thread(target=_report_every, name="kernel-service-hit-reports", daemon=True)
            _reporter.start()


def _report_every() -> None:
    while True:
        time.sleep(FLUSH_SECONDS)
        report_all()


def _forget_in_child() -> None:
    """A forked child has no reporter thread, and its parent reports the hits it inherited."""
    global _reporter, _start_lock
    _reporter, _start_lock = None, threading.Lock()
    for client in list(_clients):
        client._unreported_hits.clear()


atexit.register(report_all)  # a process that exits normally reports what it holds
os.register_at_fork(after_in_child=_forget_in_child)
