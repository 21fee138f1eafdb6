"""The compile workers: one executor per worker, so that one can be killed and replaced alone.

A build that runs past the compile timeout, or a worker that dies, costs that worker only:
the builds running on the others go on, and a fresh worker takes its place. Each worker leads a
process group that its builds' compilers join, and a killed worker's group dies with it. Worker processes
fork from a zygote that imported TileLang once (never from the daemon, whose gRPC threads a
fork does not survive), so a fresh worker is ready at once; each dies with the daemon.

The in-process form (the client's no-daemon fallback) runs builds on one thread of the
calling process. A thread cannot be killed, so no timeout applies there: a build runs to its
end, and the caller waits for it (docs/operations.md, "Compile timeout").
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool

from .build import compiler
from .fsutil import die_with_parent, kill_process_group, lead_process_group, pid_alive

__all__ = ["BrokenProcessPool", "TimedOut", "Workers", "in_process_pool", "process_pool"]


class TimedOut(Exception):
    """The call ran past its timeout; its worker was killed and a fresh one started."""


class Workers:
    """`count` workers, each an executor that runs one call at a time. `run` takes an idle one."""

    def __init__(self, count: int, new_executor: Callable[[], cf.Executor], killable: bool):
        self._new_executor = new_executor
        self.killable = killable  # processes: a timed-out or dead worker is replaced; a thread is not
        self._lock = threading.Lock()
        self._executors: list[cf.Executor] = []
        self._started: dict[cf.Executor, cf.Future] = {}  # done once the worker has imported TileLang
        self._idle: queue.SimpleQueue[cf.Executor] = queue.SimpleQueue()
        self._closed = False
        for _ in range(count):
            self._idle.put(self._add())

    def _add(self) -> cf.Executor:
        executor = self._new_executor()
        with self._lock:
            self._executors.append(executor)
        return executor

    def spawn(self) -> None:
        """Starts every worker now, from the calling thread (a spawned worker dies with the
        thread that started it). A fork from the zygote waits for the zygote's imports; a
        spawned worker's own imports are not waited for."""
        with self._lock:
            executors = list(self._executors)
        for executor in executors:
            self._start(executor)

    def _start(self, executor: cf.Executor) -> None:
        started = executor.submit(os.getpid)  # a submit to a process executor without a worker spawns one
        with self._lock:
            self._started[executor] = started

    def run(self, fn, *args, timeout: float | None = None):
        """fn(*args) on an idle worker, waiting for one. Raises TimedOut past `timeout` seconds
        (processes only: a thread runs to its end), and BrokenProcessPool when the worker died;
        either way the worker is replaced by a fresh one."""
        executor = self._idle.get()
        try:
            with self._lock:
                started = self._started.get(executor)
            try:
                if started is not None:
                    started.result()  # a worker still starting: its imports are not the call's time
                future = executor.submit(fn, *args)
                return future.result(timeout if self.killable else None)
            except TimeoutError:
                if future.done():
                    raise  # fn's own TimeoutError, not ours
                executor = self._replace(executor)
                raise TimedOut() from None
            except BrokenProcessPool:
                executor = self._replace(executor)
                raise
        finally:
            self._idle.put(executor)

    def _replace(self, executor: cf.Executor) -> cf.Executor:
        """Kills `executor`'s worker and returns a fresh one, already spawning (none once closed)."""
        _kill(executor)
        executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._closed:
                return executor
            self._executors.remove(executor)
            self._started.pop(executor, None)
        fresh = self._add()
        self._start(fresh)
        return fresh

    def started(self) -> int:
        """Workers whose start (their imports) has ended well."""
        with self._lock:
            starts = list(self._started.values())
        return sum(1 for f in starts if f.done() and f.exception() is None)

    def pids(self) -> set[int]:
        """The live workers' process ids (empty for threads)."""
        with self._lock:
            executors = list(self._executors)
        return {pid for e in executors for pid, p in (getattr(e, "_processes", None) or {}).items() if p.is_alive()}

    def kill(self) -> None:
        """Kills every worker process now (shutdown past its grace)."""
        with self._lock:
            self._closed = True
            executors = list(self._executors)
        for executor in executors:
            _kill(executor)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            executors = list(dict.fromkeys(self._executors))  # the in-process form shares one
        for executor in executors:
            executor.shutdown(wait=True, cancel_futures=True)


def _kill(executor: cf.Executor) -> None:
    """Kills the executor's worker and its build's compilers (its process group) now."""
    for proc in list((getattr(executor, "_processes", None) or {}).values()):
        if proc.is_alive():
            kill_process_group(proc.pid)


def process_pool(workers: int, initargs: tuple, start: str = "zygote", early: bool = True) -> Workers:
    """The daemon's pool: `workers` processes, each dying with the daemon.

    `start` "zygote": they fork from one process that imported TileLang once (multiprocessing's
    forkserver preloading build.zygote), started here when `early`, so that its import overlaps
    the daemon's own start, else with the first worker (a caller that may build nothing, as
    `prewarm --remote` when the tier has it all, then starts no import: the zygote would hold
    the caller's stdout and stderr open until its import ends). "spawn": each is a fresh
    interpreter that imports TileLang itself (seconds, and on a 16-core host 16 imports at once).
    """
    if start == "zygote":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["compile_service.build.zygote"])
        if early:
            multiprocessing.forkserver.ensure_running()
    elif start == "spawn":
        context = multiprocessing.get_context("spawn")
    else:
        raise ValueError(f"workers start as zygote or spawn, not {start!r}")
    daemon_pid = os.getpid()

    def one() -> cf.Executor:
        return cf.ProcessPoolExecutor(1, mp_context=context, initializer=_start_worker, initargs=(daemon_pid, *initargs))

    return Workers(workers, one, killable=True)


def _start_worker(daemon_pid: int, *initargs) -> None:
    # A killed daemon must not leave 500 MB workers behind. The worker dies with its parent: the
    # daemon, or the zygote, which exits when the daemon does (it reads EOF on a pipe whose write
    # end is the daemon's alone once its workers close the copies a fork gave them).
    _close_zygote_pipe()
    os.environ["KERNEL_SERVICE_TILELANG"] = "0"  # a spawned worker imports TileLang itself: never as a client (build/zygote.py)
    die_with_parent(os.getppid())
    if not pid_alive(daemon_pid):  # it died before the line above took effect
        os._exit(1)
    # Its builds' compilers (nvcc, g++) run in its process group, killed with it: by the daemon
    # past the compile timeout, or by the group's guard once it died with the daemon.
    lead_process_group()
    compiler.worker_init(*initargs)


def _close_zygote_pipe() -> None:
    # CPython's forkserver hands each child that write end (its alive fd) unasked; a private name,
    # so a Python that renames it leaves the pipe open, and tests/test_faults.py's kill -9 test fails.
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:  # None in a spawned worker
        os.close(fd)
        server._forkserver_alive_fd = None


def in_process_pool(workers: int, initargs: tuple) -> Workers:
    """Compiles in this process (the no-daemon fallback), on one thread: no process to spawn
    from an agent. No timeout applies (a thread cannot be killed)."""
    thread = cf.ThreadPoolExecutor(1, thread_name_prefix="compile", initializer=compiler.worker_init, initargs=initargs)
    return Workers(workers, lambda: thread, killable=False)
