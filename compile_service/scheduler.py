"""Who compiles what, when: single-flight, a bounded priority queue, a process pool.

- Single-flight: one in-flight future per key; every concurrent request for
  that key waits on it, so a kernel compiles once however many ask.
- Priorities: a request somebody is blocked on (GetKernel) goes before
  background work (Prefetch).
- The pool: `workers` driver threads, each feeding one compile at a time to a
  pool of as many worker processes (spawned, TileLang imported once each).
  Publishing to the store happens on the driver thread, outside any lock.
- Shared builds: a spec that fixes dims only the host code uses (its kind's
  `host_side_dims`) is not compiled; it waits for the build that leaves them
  to run time (requested like any other) and is published as a copy of it,
  its sizes recorded in the ABI for the loader (counted as `derived`).
- Failures are remembered: a key whose compile failed answers with that
  failure for `failure_ttl` seconds instead of compiling again for every caller.
- The budget: after each publish the driver evicts least recently used entries
  down to `max_bytes` / `max_entries` (see Store.evict).
- Shares of the queue: background work (Prefetch) may hold at most half of
  `queue_limit`, so a blocked GetKernel always finds room; the servicer holds
  one Prefetch call to a quarter (`call_share`). A caller that goes away gives
  its queued compiles back (`release`): a compile no one else waits for is
  dropped before it starts.
- A worker crash is not a compile failure: the build is retried once on a fresh
  pool, then reported as WorkerCrashed, and never remembered.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import logging
import multiprocessing
import os
import queue
import shutil
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from kernels import get_kind
from kernels.spec import CanonicalSpec
from proto import abi
from proto.wire import Outcome

from . import metrics as metrics_
from .build import compiler, devices
from .keys import cache_key
from .store import Budget, Entry, Storage, StoreError

log = logging.getLogger(__name__)

URGENT, BACKGROUND = 0, 1


class ShuttingDown(Exception):
    """The daemon is draining; no new work is accepted."""


class QueueFull(Exception):
    """More compiles are waiting than the queue allows."""


class Cancelled(Exception):
    """Everyone who asked for this compile went away before it started (a cancelled Prefetch)."""


class WorkerCrashed(Exception):
    """The compile worker's process died, twice, while building the kernel. Not remembered:
    it may have been killed from outside, or run out of memory."""


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    key: str = field(compare=False)
    spec: CanonicalSpec = field(compare=False)
    future: cf.Future = field(compare=False)
    started: bool = field(default=False, compare=False)  # a driver took it (under Scheduler._lock)
    cancelled: bool = field(default=False, compare=False)  # given back before it started: drivers skip it


def process_pool(workers: int, initargs: tuple) -> cf.Executor:
    """The daemon's pool: worker processes, each importing TileLang once. Spawned, not forked:
    the daemon runs gRPC threads, which fork does not survive."""
    return cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=compiler.worker_init, initargs=initargs)


def in_process_pool(workers: int, initargs: tuple) -> cf.Executor:
    """Compiles in this process (the no-daemon fallback): no process to spawn from an agent."""
    return cf.ThreadPoolExecutor(1, thread_name_prefix="compile", initializer=compiler.worker_init, initargs=initargs)


class Scheduler:
    def __init__(
        self,
        store: Storage,
        workers: int,
        queue_limit: int = 4096,
        plugins: dict | None = None,
        failure_ttl: float = 60.0,
        budget: Budget = Budget(),
        device: devices.DeviceCompiler = devices.get(devices.NVCC),
        warm_target: str | None = None,
        metrics: metrics_.Metrics | None = None,
        pool=process_pool,
    ):
        """`plugins`: what each worker loads beyond the zoo (kernels.plugins.load's arguments);
        `device`: the CUDA device compiler; `warm_target`: the CUDA arch whose NVRTC headers
        each worker parses at start; `pool(workers, initargs)`: the executor compiles run on."""
        self.store = store
        self.workers = workers
        self.queue_limit = queue_limit
        self.plugins = plugins or {}
        self.failure_ttl = failure_ttl
        self.budget = budget
        self.device = device
        self.warm_target = warm_target
        self.metrics = metrics or metrics_.Metrics()
        self._pool_factory = pool
        self._lock = threading.Lock()  # guards _inflight, _failed, _closing and the pool handle
        self._inflight: dict[str, cf.Future] = {}
        # Who waits on each in-flight future, so that one no caller waits on any more can be
        # dropped (release): its request count, its queued job, or the build it is a copy of.
        self._waiters: dict[cf.Future, int] = {}
        self._jobs: dict[cf.Future, _Job] = {}
        self._bases: dict[cf.Future, cf.Future] = {}
        self._background: set[cf.Future] = set()  # in flight for Prefetch (BACKGROUND) requests
        self.background_limit = max(1, queue_limit // 2)
        self.call_share = max(1, queue_limit // 4)  # compiles one Prefetch call may queue (the servicer enforces it)
        self._failed: dict[str, tuple[float, float, compiler.CompileFailed]] = {}  # key -> (expiry, when, error)
        self._keys: dict[str, tuple[str, dict]] = {}  # canonical spec JSON -> (key, spec)
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closing = False
        self._pool = self._new_pool()
        self._drivers = [threading.Thread(target=self._drive, name=f"compile-driver-{i}", daemon=True) for i in range(workers)]
        for t in self._drivers:
            t.start()

    def _new_pool(self) -> cf.Executor:
        initargs = (self.plugins, str(self.store.root), self.device.name, self.warm_target, logging.getLogger().getEffectiveLevel())
        return self._pool_factory(self.workers, initargs)

    def warm_up(self) -> None:
        """Starts every worker now, not on the first cold request: each pays TileLang's import
        once and, with NVRTC and a CUDA default target, parses the zoo's headers once."""
        futures = [self._pool.submit(time.sleep, 0.05) for _ in range(self.workers)]
        cf.wait(futures)

    # ----- requests
    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def request(self, spec: CanonicalSpec, priority: int = URGENT, counted: bool = True) -> tuple[cf.Future, Outcome]:
        """A future of the kernel's Entry, and how it is being satisfied.

        Raises ShuttingDown or QueueFull. The future raises CompileFailed or StoreError.
        `counted`: False for the service's own requests (a shared build), kept out of the stats.
        """
        tally = self.metrics.add if counted else metrics_.ignore
        if self._closing:
            raise ShuttingDown("the kernel service is shutting down")
        key, expect = self._key_of(spec)
        entry = self.store.lookup(key, expect)
        if entry is not None:
            tally(hits=1)
            return _done(entry), Outcome.HIT
        shared = get_kind(spec.kind).shared_build(spec)  # the build that serves this spec, if not its own
        with self._lock:
            if self._closing:
                raise ShuttingDown("the kernel service is shutting down")
            future = self._inflight.get(key)
            if future is not None:
                tally(misses=1, joined=1)
                self._waiters[future] = self._waiters.get(future, 0) + 1
                return future, Outcome.JOINED
            failed = self._failed.get(key)
            if failed is not None and failed[0] > time.monotonic():
                tally(failures_cached=1)
                expiry, when, exc = failed
                note = f"\n(remembered failure from {time.monotonic() - when:.0f}s ago; the compile is retried in {expiry - time.monotonic():.0f}s)"
                return _failed(compiler.CompileFailed(f"{exc}{note}")), Outcome.COMPILED
            # A compile may have published between our lookup and the lock.
            entry = self.store.lookup(key, expect)
            if entry is not None:
                tally(hits=1)
                return _done(entry), Outcome.HIT
            if len(self._inflight) >= self.queue_limit:
                raise QueueFull(f"{len(self._inflight)} compiles are already queued (limit {self.queue_limit}); retry later")
            if priority == BACKGROUND and counted and len(self._background) >= self.background_limit:
                raise QueueFull(
                    f"{len(self._background)} prefetched compiles are already queued (prefetches may take half of the queue, {self.background_limit}); retry later"
                )
            future = cf.Future()
            self._inflight[key] = future
            self._waiters[future] = 1
            if priority == BACKGROUND:
                self._background.add(future)
            if shared is None:
                job = self._jobs[future] = _Job(priority, next(self._seq), key, spec, future)
                self._queue.put(job)
        tally(misses=1)
        if shared is not None:
            self._serve_from_shared_build(key, spec, shared, priority, future)
        return future, Outcome.COMPILED

    def _serve_from_shared_build(self, key: str, spec: CanonicalSpec, shared: tuple[CanonicalSpec, dict], priority: int, future: cf.Future) -> None:
        """`spec` is published as a copy of the build that leaves its host-side dims to run
        time, once that is built (or found): no lowering, no device compile of its own."""
        build_spec, fixed = shared
        try:
            base, _ = self.request(build_spec, priority, counted=False)
        except (ShuttingDown, QueueFull) as exc:  # refused like the request itself; joiners learn why
            with self._lock:
                self._inflight.pop(key, None)
                self._forget(future)
            future.set_exception(exc)
            raise
        with self._lock:
            if not base.done():
                self._bases[future] = base  # releasing the copy releases the build it waits on
        # Runs on the thread that finishes `base` (a driver), or here when it is already done.
        base.add_done_callback(lambda done: self._settle(key, spec, future, lambda staging: _derive(done.result(), spec, fixed, staging), derived=True))

    def key_of(self, spec: CanonicalSpec) -> str:
        return self._key_of(spec)[0]

    def _key_of(self, spec: CanonicalSpec) -> tuple[str, dict]:
        """The key, and the spec the entry must record (a key collision or a planted entry is
        corrupt); remembered per spec, since hits repeat the same few."""
        text = spec.to_json()
        known = self._keys.get(text)
        if known is None:
            if len(self._keys) >= 4096:
                self._keys.clear()
            known = self._keys[text] = (cache_key(spec, self.device.id), json.loads(text))
        return known

    def release(self, futures) -> int:
        """The caller of `request` no longer waits for these futures (a Prefetch that was
        cancelled or refused). A compile that then has no waiter left and has not started is
        dropped: out of the queue and the in-flight table, its future failed with Cancelled.
        Returns how many were dropped."""
        dropped: list[cf.Future] = []
        with self._lock:
            pending = list(futures)
            while pending:
                future = pending.pop()
                if future not in self._waiters:
                    continue  # settled meanwhile, or never in flight
                self._waiters[future] -= 1
                if self._waiters[future] > 0:
                    continue
                job = self._jobs.get(future)
                if job is not None and not job.started:
                    job.cancelled = True
                    self._inflight.pop(job.key, None)
                    self._forget(future)
                    dropped.append(future)
                elif future in self._bases:  # a copy: its build may now have no waiter
                    pending.append(self._bases[future])
        for future in dropped:
            future.set_exception(Cancelled("everyone who asked for this kernel went away before its compile started"))
        if dropped:
            log.info("dropped %d queued compiles their callers gave up on", len(dropped))
        return len(dropped)

    def _forget(self, future: cf.Future) -> None:
        """Drops the bookkeeping of a future that left the in-flight table (caller holds _lock)."""
        for table in (self._waiters, self._jobs, self._bases):
            table.pop(future, None)
        self._background.discard(future)

    # ----- the drivers
    def _drive(self) -> None:
        while True:
            job = self._queue.get()
            if job.spec is None:  # shutdown sentinel
                return
            with self._lock:
                if job.cancelled:
                    continue
                job.started = True
            self._run(job)

    def _run(self, job: _Job) -> None:
        def build(staging: Path) -> tuple[str, dict]:
            for attempt in (1, 2):
                with self._lock:
                    pool = self._pool
                try:
                    result = pool.submit(compiler.build, job.spec.to_json(), str(staging)).result()
                    return result["library"], result["meta"]
                except BrokenProcessPool:
                    # The process died under us (a crash, an OOM kill, a signal): not the kernel's
                    # fault as far as we know. Retry once on a fresh pool, then say what happened.
                    if self._closing:
                        raise ShuttingDown("the kernel service shut down while compiling this kernel") from None
                    self._replace_pool(pool)
                    if attempt == 2:
                        raise WorkerCrashed("the compiler worker crashed (its process died) twice while building this kernel; it is not remembered as a compile failure") from None
                    log.warning("the compiler worker crashed while building %s; retrying once on a fresh worker", job.key[:16])
                    _empty(staging)
                except OSError as exc:  # the worker could not write the staging dir (disk full)
                    raise StoreError(exc.errno, f"cannot write the built kernel into {staging}: {exc.strerror or exc}") from exc
            raise AssertionError("unreachable")

        self._settle(job.key, job.spec, job.future, build)

    def _settle(self, key: str, spec: CanonicalSpec, future: cf.Future, produce, derived: bool = False) -> None:
        """Fills a staging dir with `produce(staging) -> (library, meta)`, publishes it as `key`,
        and settles `future` with the entry or the error; never leaves a waiter hanging.
        `derived`: `produce` copies a shared build (counted apart from compiles)."""
        staging = None
        try:
            if self._closing:
                raise ShuttingDown("the kernel service shut down before this kernel was compiled")
            staging = self.store.new_staging(key)
            library, meta = produce(staging)
            outcome: Entry | BaseException = self.store.put(key, staging, library, meta)
            if derived:
                self.metrics.add(derived=1)
            else:
                self.metrics.add(compiles=1, compile_seconds=meta["compile_seconds"], device_compile_seconds=meta["phases"]["device"])
            self.enforce_budget(protect=key)
        except (compiler.CompileFailed, StoreError, ShuttingDown, WorkerCrashed, Cancelled) as exc:
            outcome = exc
        except BaseException as exc:  # never leave waiters hanging
            log.exception("unexpected error compiling %s", key[:16])
            outcome = exc
        finally:
            if staging is not None:
                self.store.discard_staging(staging)
        if isinstance(outcome, BaseException) and not isinstance(outcome, (ShuttingDown, Cancelled)):
            if not derived:
                self.metrics.add(failures=1)
            log.warning("compile of %s failed: %s", spec.to_json(), str(outcome)[:500])
        # Leave the in-flight table before answering: a later request then finds the entry on
        # disk, or the remembered failure (a cache write error is not remembered: it may clear).
        with self._lock:
            self._inflight.pop(key, None)
            self._forget(future)
            if isinstance(outcome, compiler.CompileFailed) and self.failure_ttl > 0:
                now = time.monotonic()
                self._failed = {k: v for k, v in self._failed.items() if v[0] > now}
                self._failed[key] = (now + self.failure_ttl, now, outcome)
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def enforce_budget(self, protect: str | None = None) -> None:
        """Evicts down to the budget (after each publish, and once at start-up)."""
        try:
            self.store.evict(self.budget, protect)
        except OSError as exc:  # the budget is housekeeping: it never fails a request
            log.warning("eviction pass failed: %s", exc)

    def _replace_pool(self, broken: cf.Executor) -> None:
        """Replaces `broken` with a fresh pool, once: every driver whose job was on it calls this,
        and none of them may throw away the pool another one just made."""
        with self._lock:
            if self._closing or self._pool is not broken:
                return
            self._pool = self._new_pool()
        broken.shutdown(wait=False, cancel_futures=True)

    # ----- shutdown
    def shutdown(self, grace: float) -> None:
        """Refuses new work, lets running compiles finish for up to `grace` seconds,
        then kills the workers. Queued jobs fail with ShuttingDown; no staging is left."""
        with self._lock:
            self._closing = True
        for _ in self._drivers:
            self._queue.put(_Job(BACKGROUND + 1, next(self._seq), "", None, cf.Future()))
        deadline = time.monotonic() + grace
        for t in self._drivers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._drivers):
            log.warning("compiles still running after %.1fs grace; stopping the workers", grace)
            _kill_workers(self._pool)
            for t in self._drivers:
                t.join(10)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _derive(base: Entry, spec: CanonicalSpec, fixed: dict, staging: Path) -> tuple[str, dict]:
    """An entry for `spec` made of `base`'s files: the same library, with the dims `spec` fixes
    recorded in the ABI for the loader to enforce. The files are hard links to `base`'s: the
    store keeps their bytes once (store.blobs)."""
    start = time.perf_counter()
    try:
        for name in (base.library, *abi.SOURCES):
            if (base.path / name).is_file():
                os.link(base.path / name, staging / name)
    except OSError as exc:  # a full disk, or the shared build evicted under a zero min-age budget
        raise StoreError(exc.errno, f"cannot copy the shared build {base.key[:16]} into {staging}: {exc.strerror or exc}") from exc
    meta = {
        **{k: v for k, v in base.meta.items() if k not in ("phases", "device_compiled")},
        "spec": json.loads(spec.to_json()),
        "abi": abi.with_fixed(base.abi, fixed),
        "shared_build": {"key": base.key, "spec": base.meta["spec"], "compile_seconds": base.meta["compile_seconds"]},
        "created": time.time(),
    }
    meta["compile_seconds"] = round(time.perf_counter() - start, 4)
    return base.library, meta


def _empty(directory: Path) -> None:
    """Removes what a crashed build left in its staging directory."""
    for item in directory.iterdir():
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)


def _done(entry: Entry) -> cf.Future:
    future = cf.Future()
    future.set_result(entry)
    return future


def _failed(exc: BaseException) -> cf.Future:
    future = cf.Future()
    future.set_exception(exc)
    return future


def _kill_workers(pool: cf.ProcessPoolExecutor) -> None:
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        if proc.is_alive():
            proc.kill()
