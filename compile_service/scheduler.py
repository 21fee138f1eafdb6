"""Who compiles what, when: single-flight, a bounded priority queue, a process pool.

- Single-flight: one in-flight future per key; every concurrent request for
  that key waits on it, so a kernel compiles once however many ask.
- Priorities: a request somebody is blocked on (GetKernel) goes before
  background work (Prefetch).
- The pool: `workers` driver threads, each feeding one compile at a time to a
  pool of as many worker processes (compile_service.workers: forked from a
  zygote that imported TileLang once). Publishing to the store happens outside any lock.
- The memory budget: a build starts only while the measured peaks of the builds
  running and its own fit the memory limit (compile_service.memory); else its
  driver waits. Warm-up steps are admitted the same way.
- The compile timeout: a build past `compile_timeout` seconds has its worker
  killed and replaced (the other workers' builds go on) and fails with
  CompileTimeout, remembered like any compile failure. In-process (the
  no-daemon fallback) a thread cannot be killed: no timeout applies there.
- Shared builds: a spec that fixes dims only the host code uses (its kind's
  `host_side_dims`) is not compiled; it waits for the build that leaves them
  to run time (requested like any other) and is published as a copy of it,
  its sizes recorded in the ABI for the loader (counted as `derived`). A router
  is a copy of its last range's build the same way; its other ranges are queued
  after it (LATER, below every request) and are not waited for (compile_service.copies).
  A LATER build starts only while no request's build runs: a cold model's first builds
  have every worker and core to themselves, and the other ranges come once they are done.
- A request that joins a queued build it outranks (a GetKernel joining a prefetched
  or LATER build) moves that build up to its own priority.
- Failures are remembered: a key whose compile failed answers with that
  failure for `failure_ttl` seconds instead of compiling again for every caller.
- Other hosts: before compiling, a driver asks for a claim on the key (Claims.claim:
  the scheduler is handed the store's claims). The fleet's (store.tiered) may answer
  with the entry another host built, a failure it saw, or "being built elsewhere":
  the job then waits outside the queue, and the claims wake it to ask again.
- The budget: after each publish the driver evicts least recently used entries
  down to `max_bytes` / `max_entries` (see Store.evict).
- Publishing (hashes, fsyncs, a rename) runs on a few publisher threads, not on
  the driver: a worker takes its next job as soon as its build is done.
- Warm-up in the background (compile_service.warmup): steps in the queue below
  every request, run only when no build has run for a moment, one worker always
  left free for a request.
- Serving only (compile_service.serve_only): a request that may not compile (a
  strict client), or any request to a scheduler made with `compiles=False`
  (`serve --no-compile`: no workers at all), is answered from the cache, else
  fetched from other builders (Claims.fetch), else its future raises NotReady. A
  shared build's copy is still made when its build is here or fetched, since
  copying compiles nothing.
- Shares of the queue: background work (Prefetch) may hold at most half of
  `queue_limit`, so a blocked GetKernel always finds room; the servicer holds
  one Prefetch call to a quarter (`call_share`). A caller that goes away gives
  its queued compiles back (`release`): a compile no one else waits for is
  dropped before it starts.
- A worker crash is not a compile failure: the worker is replaced, the build is
  retried once, then reported as WorkerCrashed, and never remembered.
- A key describes the source that was built: a build whose worker imported other
  source than the key was made from (a file edited after the daemon started, and
  a worker started since) is not published (SourceChanged, never remembered).
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import itertools
import json
import logging
import math
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernels import label
from kernels.spec import CanonicalSpec
from proto.memo import Memo
from proto.wire import Outcome

from . import logs
from . import memory as memory_
from . import metrics as metrics_
from .build import compiler, devices
from .copies import Plan, plan_of
from .futures import done, failed, settle, when_all_done
from .keys import cache_key, toolchain
from .serve_only import NotReady, ServeOnly
from .store import BUILD, Budget, Claim, Claims, Entry, Storage, StoreError
from .warmup import WarmUp
from .workers import BrokenProcessPool, TimedOut, Workers, in_process_pool, process_pool  # noqa: F401 - the pools Scheduler(pool=...) takes

log = logging.getLogger(__name__)

URGENT, BACKGROUND = 0, 1
LATER = 2  # the builds a router names beyond the one it waits for (Plan.after): after every request
_WARM, _STOP = 3, 4  # below every build: a worker's warm-up step; a driver's shutdown sentinel


class ShuttingDown(Exception):
    """The daemon is draining; no new work is accepted."""


class QueueFull(Exception):
    """More compiles are waiting than the queue allows."""


class Cancelled(Exception):
    """Everyone who asked for this compile went away before it started (a cancelled Prefetch)."""


class CompileTimeout(compiler.CompileFailed):
    """The build ran past the compile timeout; its worker was killed. Remembered like a compile failure."""


MEMO_SPEC = 4096  # characters of a spec's JSON that per-spec memos keep; larger specs are worked out again each time


class WorkerCrashed(Exception):
    """The compile worker's process died, twice, while building the kernel. Not remembered:
    it may have been killed from outside, or run out of memory."""


class SourceChanged(Exception):
    """A worker built a kind from other source (or TileLang) than this daemon's keys describe: a
    worker started after a file was edited imports the edited one. Nothing is published, and it
    is not remembered as a compile failure: a worker that imported the daemon's source may
    build it."""


# ----- the scheduler's records (their fields change under Scheduler._lock only)
class _Stage(enum.Enum):
    """Where a flight's own build is."""

    QUEUED = "queued"  # waiting for a driver: release() may still drop it
    STARTED = "started"  # a driver took it (claiming, building, publishing)
    PARKED = "parked"  # asking for a claim, or another host is building it: the claims wake it
    CANCELLED = "cancelled"  # dropped before it started: drivers skip it


class _Future(cf.Future):
    """A flight's future. It names its key: release() finds the flight by it."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key


@dataclass(eq=False)
class _Flight:
    """One key being made, from the request that missed it until its future settles."""

    key: str
    spec: CanonicalSpec
    background: bool  # asked for by Prefetch (BACKGROUND, or LATER): counted against background_limit
    priority: int  # of its queued build (a joiner that outranks it moves it up)
    stage: _Stage | None  # of its own build; None: made from other builds (a shared build, a router)
    waiters: int = 1  # requests (and copies) waiting on it; at none, a queued build may be dropped
    bases: list[cf.Future] = field(default_factory=list)  # the builds it is made from, released with it
    future: _Future = field(init=False)

    def __post_init__(self):
        self.future = _Future(self.key)

    @property
    def derived(self) -> bool:
        """Made from other builds' entries, not compiled (counted apart from compiles)."""
        return self.stage is None


class _Flights:
    """The single-flight table: one _Flight per key being made, and how many are background work."""

    def __init__(self):
        self._by_key: dict[str, _Flight] = {}
        self.background = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> _Flight | None:
        return self._by_key.get(key)

    def of(self, future: cf.Future) -> _Flight | None:
        """The flight `future` is the future of, while it is in the table."""
        flight = self._by_key.get(getattr(future, "key", None))
        return flight if flight is not None and flight.future is future else None

    def add(self, flight: _Flight) -> None:
        self._by_key[flight.key] = flight
        self.background += flight.background

    def remove(self, flight: _Flight) -> None:
        if self._by_key.get(flight.key) is flight:
            del self._by_key[flight.key]
            self.background -= flight.background


@dataclass(frozen=True)
class _Remembered:
    error: compiler.CompileFailed
    when: float  # time.monotonic() at the failure
    expiry: float


class _Failures:
    """Compile failures remembered for a while: a key that failed answers with its failure until
    it expires, instead of compiling again for every caller."""

    def __init__(self):
        self._by_key: dict[str, _Remembered] = {}

    def remember(self, key: str, error: compiler.CompileFailed, ttl: float) -> None:
        now = time.monotonic()
        self._by_key = {k: r for k, r in self._by_key.items() if r.expiry > now}  # the expired ones go
        self._by_key[key] = _Remembered(error, now, now + ttl)

    def recall(self, key: str) -> compiler.CompileFailed | None:
        """The failure remembered for `key`, saying how old it is and when it is retried; None
        when none is (or it expired)."""
        remembered, now = self._by_key.get(key), time.monotonic()
        if remembered is None or remembered.expiry <= now:
            return None
        note = f"\n(remembered failure from {now - remembered.when:.0f}s ago; the compile is retried in {remembered.expiry - now:.0f}s)"
        return type(remembered.error)(f"{remembered.error}{note}")  # a timeout stays a timeout


@dataclass(frozen=True)
class _Built:
    """What a build hands its publisher: the library and metadata it left in `staging`, or the
    error that stopped it (then `staging`, if it was made, is only discarded)."""

    staging: Path | None
    library: str = ""
    meta: dict = field(default_factory=dict)
    error: BaseException | None = None


@dataclass(order=True)
class _Job:
    """An item of the drivers' queue: a flight's build, or (no flight) a warm-up step or a stop."""

    priority: int
    seq: int
    flight: _Flight | None = field(default=None, compare=False)


class Scheduler:
    def __init__(
        self,
        store: Storage,
        claims: Claims,
        workers: int,
        queue_limit: int = 4096,
        plugins: dict | None = None,
        failure_ttl: float = 60.0,
        budget: Budget = Budget(),
        device: devices.DeviceCompiler = devices.get(devices.NVCC),
        warm_target: str | None = None,
        metrics: metrics_.Metrics | None = None,
        pool=process_pool,
        start: bool = True,
        compiles: bool = True,
        compile_timeout: float | None = None,
        memory: memory_.BuildMemory | None = None,
    ):
        """`store`: where entries are looked up and published; `claims`: the claims on builds
        asked before building a key (the store's `claims`: another builder may have it);
        `plugins`: what each worker loads beyond the zoo (kernels.plugins.load's arguments);
        `device`: the CUDA device compiler (its id is in every CUDA key); `warm_target`: the
        CUDA arch whose NVRTC headers each worker parses at start; `pool(workers, initargs)`:
        the workers compiles run on (compile_service.workers); `start=False`: no worker starts,
        and nothing is compiled, until start_workers(); `compiles=False`: serve only, with no
        workers; `compile_timeout`: seconds a build may run in a worker process (None: no
        limit); `memory`: admits builds within the memory limit (None: no limit)."""
        self.store = store
        self.claims = claims
        self.workers = workers
        self.queue_limit = queue_limit
        self.plugins = plugins or {}
        self.failure_ttl = failure_ttl
        self.budget = budget
        self.device = device
        self.warm_target = warm_target
        self.metrics = metrics or metrics_.Metrics()
        self._pool_factory = pool
        self.compile_timeout = compile_timeout
        self.memory = memory or memory_.BuildMemory(None)
        self._lock = threading.Lock()  # guards the flights, the failures, _closing, _running and _last_build
        self._flights = _Flights()
        self._failures = _Failures()
        self.background_limit = max(1, queue_limit // 2)
        self.call_share = max(1, queue_limit // 4)  # compiles one Prefetch call may queue (the servicer enforces it)
        self._keys: Memo = Memo()  # canonical spec JSON -> (key, spec)
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closing = False
        self._running = 0  # builds a driver is waiting on
        self._asked = 0  # jobs of requests (above LATER) that drivers are running: LATER ones wait for none
        self._deferred: list[_Job] = []  # LATER jobs taken while some were: queued again when none is
        self._last_build = -math.inf  # when the last build ended (time.monotonic)
        self._started = threading.Event()  # drivers submit nothing before start_workers()
        self.compiles = compiles
        self._pool = self._new_pool() if compiles else None
        self._publisher = cf.ThreadPoolExecutor(max(2, min(8, workers // 2)), thread_name_prefix="publish")  # copies too
        self._serve_only = ServeOnly(claims, self._publish, compiles)
        self._warmup = WarmUp(self._pool, workers, self.memory, lambda: self._queue.put(_Job(_WARM, next(self._seq))), self._last_build_end)
        self._drivers = [threading.Thread(target=self._drive, name=f"compile-driver-{i}", daemon=True) for i in range(workers if compiles else 0)]
        for t in self._drivers:
            t.start()
        if start:
            self.start_workers()

    def start_workers(self) -> None:
        """Starts every worker now, from the calling thread, and their warm-up on a cache that
        holds no kernel (otherwise the first build starts it: compile_service.warmup). A spawned
        worker dies with the thread that started it (die_with_parent): the daemon calls this
        from a thread that lives as long as it does, right after it says SERVING. Outside the
        lock: the first fork waits for the zygote's imports."""
        if self._pool is None:  # serving only
            return
        self._pool.spawn()
        if next(iter(self.store.records()), None) is None:
            self._warmup.start()
        self._started.set()

    def _new_pool(self) -> Workers:
        initargs = (self.plugins, str(self.store.root), self.device.name, self.warm_target, logs.chosen())
        return self._pool_factory(self.workers, initargs)

    # ----- requests
    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    @property
    def running(self) -> int:
        """Builds running in workers now."""
        with self._lock:
            return self._running

    @property
    def queued(self) -> int:
        """Builds waiting for a worker."""
        with self._lock:
            return max(0, len(self._flights) - self._running)

    @property
    def workers_ready(self) -> int:
        """Workers that have started and finished their warm-up (TileLang imported; with NVRTC,
        their precompiled headers built)."""
        return self._warmup.ready

    def request(self, spec: CanonicalSpec, priority: int = URGENT, counted: bool = True, compile: bool = True) -> tuple[cf.Future, Outcome]:
        """A future of the kernel's Entry, and how it is being satisfied.

        Raises ShuttingDown or QueueFull; never waits on other hosts. The future raises
        CompileFailed or StoreError, and NotReady for a miss where `compile` is False or the
        scheduler compiles nothing, and no other builder has it (asked off this thread).
        `counted`: False for the service's own requests (a shared build), kept out of the stats.
        """
        tally = self.metrics.add if counted else metrics_.ignore
        if self._closing:
            raise ShuttingDown("the kernel service is shutting down")
        key, expect = self._key_of(spec)
        entry = self.store.lookup(key, expect)
        if entry is not None:  # a hit: no lock, nothing more
            tally(hits=1)
            return done(entry), Outcome.HIT
        return self._miss(spec, key, expect, priority, counted, compile, tally)

    def _miss(self, spec: CanonicalSpec, key: str, expect: dict, priority: int, counted: bool, compile: bool, tally) -> tuple[cf.Future, Outcome]:
        """`request` past a missed lookup: fetched from other builders when it may not compile
        (its builds, for a copy of builds not all here), else made (_make)."""
        plan = plan_of(spec)
        if not (compile and self.compiles):
            if not plan.bases:
                return self._serve_only.fetch(spec, key, expect, tally)
            keyed = [(build, *self._key_of(build)) for build in plan.bases]
            missing = [(build, k, e) for build, k, e in keyed if self.store.lookup(k, e) is None]
            if missing:  # fetched, then copied as any copy is

                def copy() -> cf.Future:
                    return self._make(spec, key, expect, priority, counted, False, tally, plan)[0]

                return self._serve_only.fetch_builds(spec, key, missing, tally, copy), Outcome.COMPILED
        return self._make(spec, key, expect, priority, counted, compile, tally, plan)

    def _make(self, spec: CanonicalSpec, key: str, expect: dict, priority: int, counted: bool, compile: bool, tally, plan: Plan) -> tuple[cf.Future, Outcome]:
        """A missed key that may be compiled, or a copy whose builds are here: refused, joined to
        the key's flight, answered with its remembered failure, or a new flight, its build
        queued or made from other builds."""
        with self._lock:
            if self._closing:
                raise ShuttingDown("the kernel service is shutting down")
            flight = self._flights.get(key)
            if flight is not None:
                return self._join(flight, priority, tally), Outcome.JOINED
            failure = self._failures.recall(key)
            if failure is not None:
                tally(failures_cached=1)
                return failed(failure), Outcome.COMPILED
            # A compile may have published between our lookup and the lock.
            entry = self.store.lookup(key, expect)
            if entry is not None:
                tally(hits=1)
                return done(entry), Outcome.HIT
            flight = self._enqueue(key, spec, priority, counted, plan)
        tally(misses=1)
        if plan.bases:
            self._serve_from_builds(flight, plan, priority, compile)
        else:
            self._warmup.start()  # this daemon builds: its workers warm up in the gaps between builds
        for build in plan.after:  # named, not waited for: made once the queue has nothing else
            try:
                self.request(build, LATER, counted=False, compile=compile)
            except (ShuttingDown, QueueFull):
                pass  # whoever loads it asks again
        return flight.future, Outcome.COMPILED

    def _join(self, flight: _Flight, priority: int, tally) -> cf.Future:
        """One more waiter on a key already in flight, its queued build moved up to `priority`
        if that is higher (caller holds _lock; the build's older place in the queue is skipped)."""
        tally(misses=1, joined=1)
        flight.waiters += 1
        if flight.stage is _Stage.QUEUED and priority < flight.priority:
            flight.priority = priority
            self._queue.put(_Job(priority, next(self._seq), flight))
        return flight.future

    def _enqueue(self, key: str, spec: CanonicalSpec, priority: int, counted: bool, plan: Plan) -> _Flight:
        """A new flight for `key`, its build queued unless it is made from other builds (caller
        holds _lock). Raises QueueFull past the queue's limit, or background work's half of it."""
        background = priority == BACKGROUND or (counted and priority == LATER)  # a Prefetch's, later or not
        if len(self._flights) >= self.queue_limit:
            raise QueueFull(f"{len(self._flights)} compiles are already queued (limit {self.queue_limit}); retry later")
        if background and counted and self._flights.background >= self.background_limit:
            raise QueueFull(
                f"{self._flights.background} prefetched compiles are already queued (prefetches may take half of the queue, {self.background_limit}); retry later"
            )
        flight = _Flight(key, spec, background=background, priority=priority, stage=None if plan.bases else _Stage.QUEUED)
        self._flights.add(flight)
        if not plan.bases:
            self._queue.put(_Job(priority, next(self._seq), flight))
        return flight

    def _serve_from_builds(self, flight: _Flight, plan: Plan, priority: int, compile: bool) -> None:
        """`flight` is published as `plan.make(entries, staging)` of other builds, once they are
        all built (or found): no lowering, no device compile of its own."""
        bases: list[cf.Future] = []
        try:
            for build in plan.bases:
                bases.append(self.request(build, priority, counted=False, compile=compile)[0])
        except (ShuttingDown, QueueFull) as exc:  # refused like the request itself; joiners learn why
            self.release(bases)
            with self._lock:
                self._flights.remove(flight)
            flight.future.set_exception(exc)
            raise
        with self._lock:
            flight.bases = [b for b in bases if not b.done()]  # releasing this releases the builds it waits on
        # Published by a publisher thread once every build is done (at once when they are).
        when_all_done(bases, lambda: self._publish(self._publish_derived, flight, bases, plan.make))

    def _publish_derived(self, flight: _Flight, bases: list[cf.Future], make) -> None:
        staging = None
        try:
            if self._closing:
                raise ShuttingDown("the kernel service shut down before this kernel was compiled")
            entries = [base.result() for base in bases]
            staging = self.store.new_staging(flight.key)
            built = _Built(staging, *make(entries, staging))
        except BaseException as exc:  # noqa: BLE001 - settled below
            built = _Built(staging, error=exc)
        self._settle(flight, built)

    def key_of(self, spec: CanonicalSpec) -> str:
        return self._key_of(spec)[0]

    def remembered_failure(self, key: str) -> str | None:
        """The full text of the compile failure remembered for `key` (Explain's), or None."""
        with self._lock:
            failure = self._failures.recall(key)
        return None if failure is None else str(failure)

    def build_keys(self, spec: CanonicalSpec) -> list[str]:
        """The keys of the builds `spec` is served from: its own, or those of the builds it is
        a copy of (the entries other hosts share: each host makes the copies itself)."""
        return [self.key_of(build) for build in plan_of(spec).bases] or [self.key_of(spec)]

    def _key_of(self, spec: CanonicalSpec) -> tuple[str, dict]:
        """The key, and the spec the entry must record (a key collision or a planted entry is
        corrupt); remembered per spec, since hits repeat the same few."""
        text = spec.to_json()
        known = self._keys.get(text)
        if known is None:
            known = (cache_key(spec, self.device.id), json.loads(text))
            if len(text) <= MEMO_SPEC:  # a TileLang program's spec is tens of kilobytes: not kept
                self._keys.remember(text, known)
        return known

    def release(self, futures) -> int:
        """The caller of `request` no longer waits for these futures (a GetKernel or Prefetch
        that was cancelled or ran past its deadline, a Prefetch refused). A compile that then
        has no waiter left and has not started is dropped: out of the queue and the in-flight
        table, its future failed with Cancelled. Returns how many were dropped."""
        dropped: list[_Flight] = []
        with self._lock:
            pending = list(futures)
            while pending:
                flight = self._flights.of(pending.pop())
                if flight is None:
                    continue  # settled meanwhile, or never in flight
                flight.waiters -= 1
                if flight.waiters > 0:
                    continue
                if flight.stage is _Stage.QUEUED:
                    flight.stage = _Stage.CANCELLED
                    self._flights.remove(flight)
                    dropped.append(flight)
                else:  # a copy or a router: its builds may now have no waiter (a started build has none listed)
                    pending.extend(flight.bases)
        for flight in dropped:
            flight.future.set_exception(Cancelled("everyone who asked for this kernel went away before its compile started"))
        if dropped:
            log.info("dropped %d queued compiles their callers gave up on", len(dropped))
        return len(dropped)

    # ----- the drivers
    def _drive(self) -> None:
        self._started.wait()
        while True:
            job = self._queue.get()
            if job.priority == _STOP:
                return
            if job.priority == _WARM:
                self._warmup.take()
                continue
            asked = job.priority < LATER
            with self._lock:
                if job.flight.stage is not _Stage.QUEUED:
                    continue  # cancelled, or taken already from the place a joiner moved it up to
                if not asked and self._asked and not self._closing:
                    self._deferred.append(job)  # back in the queue when the last request's job ends
                    continue
                job.flight.stage = _Stage.STARTED
                self._asked += asked
            try:
                self._run(job)
            finally:
                if asked:
                    self._request_job_ended()

    def _request_job_ended(self) -> None:
        """A request's job is off its driver (built, found, or parked): when it was the last
        one, the LATER jobs held meanwhile go back to the queue."""
        with self._lock:
            self._asked -= 1
            woken = self._deferred if not self._asked else []
            if woken:
                self._deferred = []
        for job in woken:
            self._queue.put(job)

    def _last_build_end(self) -> float | None:
        """When the last build ended (time.monotonic); None while one runs (the warm-up waits)."""
        with self._lock:
            return None if self._running else self._last_build

    def _run(self, job: _Job) -> None:
        """Asks for a claim on the key; builds the job in a worker when it is this
        host's to build, then hands the result to a publisher thread."""
        flight = job.flight
        claim = self._claim(job)
        if claim.waiting:
            return  # another host is building it; the claims wake the job when that is over
        if claim.entry is not None:
            self._finish(flight, claim.entry)
            return
        if claim.failure is not None:
            self.metrics.add(failures_cached=1)
            log.warning("compile of %s failed on another host: %s", label(flight.spec), claim.failure)
            self._finish(flight, compiler.CompileFailed(claim.failure), remember=claim.failure_ttl)
            return
        self._publish(self._settle, flight, self._build(flight))

    def _build(self, flight: _Flight) -> _Built:
        """The flight's kernel, built in a worker into a new staging directory, once its
        kind's peak fits the memory limit."""
        staging = None
        with self.memory.admit(flight.spec.kind):
            with self._lock:
                self._running += 1
            try:
                if self._closing:
                    raise ShuttingDown("the kernel service shut down before this kernel was compiled")
                staging = self.store.new_staging(flight.key)
                result = self._build_in_worker(flight, staging)
                return _Built(staging, result["library"], result["meta"])
            except BaseException as exc:  # noqa: BLE001 - settled (and logged) by _settle
                return _Built(staging, error=exc)
            finally:
                with self._lock:
                    self._running -= 1
                    self._last_build = time.monotonic()

    def _claim(self, job: _Job) -> Claim:
        """The claim on the key before building it: parked first, since claims that answer
        "waiting" may wake the job before it has answered."""
        flight = job.flight
        with self._lock:
            flight.stage = _Stage.PARKED
        try:
            claim = self.claims.claim(flight.key, self._key_of(flight.spec)[1], lambda: self._resume(job))
        except Exception:  # a store's trouble with other hosts never fails a request
            log.exception("claiming %s failed; building it here", flight.key[:16])
            claim = BUILD
        if not claim.waiting:
            with self._lock:
                if flight.stage is _Stage.PARKED:
                    flight.stage = _Stage.STARTED
        return claim

    def _resume(self, job: _Job) -> None:
        """Called by the claims once another host's build of the job's key is over: ask again
        (queued as before, so a caller that has gone away meanwhile may still drop it)."""
        flight = job.flight
        with self._lock:
            if flight.stage is not _Stage.PARKED:
                return
            if not self._closing:
                flight.stage = _Stage.QUEUED
                self._queue.put(job)
                return
            flight.stage = _Stage.STARTED  # woken once only
        self._finish(flight, ShuttingDown("the kernel service shut down while another host was building this kernel"))

    def _build_in_worker(self, flight: _Flight, staging: Path) -> dict:
        kind = flight.spec.kind
        for attempt in (1, 2):
            try:
                result, peak = self._pool.run(memory_.measured, compiler.build, flight.spec.to_json(), str(staging), timeout=self.compile_timeout)
                self.memory.record(kind, peak)
                self._check_source(flight.spec, result["meta"]["toolchain"])
                return result
            except TimedOut:
                self.metrics.add(compile_timeouts=1)
                self._warmup.worker_replaced()
                raise CompileTimeout(
                    f"compiling this {kind} kernel ran past the compile timeout of {self.compile_timeout:g} s (--compile-timeout); "
                    "its worker was killed and a fresh one started"
                ) from None
            except BrokenProcessPool:
                # The process died under us (a crash, an OOM kill, a signal): not the kernel's
                # fault as far as we know. Retry once on a fresh worker, then say what happened.
                if self._closing:
                    raise ShuttingDown("the kernel service shut down while compiling this kernel") from None
                self._warmup.worker_replaced()
                if attempt == 2:
                    raise WorkerCrashed(
                        "the compiler worker crashed (its process died) twice while building this kernel; it is not remembered as a compile failure"
                    ) from None
                log.warning("the compiler worker crashed while building %s; retrying once on a fresh worker", flight.key[:16])
                _empty(staging)
            except OSError as exc:  # the worker could not write the staging dir (disk full)
                raise StoreError(exc.errno, f"cannot write the built kernel into {staging}: {exc.strerror or exc}") from exc
        raise AssertionError("unreachable")

    def _check_source(self, spec: CanonicalSpec, built_with: dict) -> None:
        """A key must describe the source that was built: the toolchain a build records (the
        kind's source digest as its worker read it right after importing it) must be the one
        the key was made from. Raises SourceChanged."""
        keyed_with = toolchain(spec.kind, spec.target.kind, self.device.id)
        if built_with != keyed_with:
            changed = ", ".join(
                f"{name} {keyed_with.get(name)} -> {built_with.get(name)}" for name in keyed_with if built_with.get(name) != keyed_with.get(name)
            )
            raise SourceChanged(
                f"not published: the compile worker that built this {spec.kind} kernel imported other code than this daemon's keys "
                f"describe ({changed}): the files changed on disk after the daemon started. Restart the daemon to serve them, or restore them"
            )

    def _publish(self, fn, *args) -> None:
        try:
            self._publisher.submit(fn, *args)
        except RuntimeError:  # the publishers are shutting down: publish on this thread
            fn(*args)

    def _settle(self, flight: _Flight, built: _Built) -> None:
        """Publishes `built` as the flight's key, or takes its error, and settles the flight with
        the entry or the error; never leaves a waiter hanging."""
        key, spec = flight.key, flight.spec
        try:
            if built.error is not None:
                raise built.error
            outcome: Entry | BaseException = self._put(flight, built)
        except (compiler.CompileFailed, StoreError, ShuttingDown, WorkerCrashed, SourceChanged, Cancelled, NotReady) as exc:
            outcome = exc
        except BaseException as exc:  # never leave waiters hanging
            log.exception("unexpected error compiling %s", key[:16])
            outcome = exc
        finally:
            if built.staging is not None:
                self.store.discard_staging(built.staging)
        if isinstance(outcome, BaseException) and not isinstance(outcome, (ShuttingDown, Cancelled, NotReady)):
            if not flight.derived:
                self.metrics.add(failures=1)
            log.warning("compile of %s failed: %s", label(spec), outcome)  # in full: the client's copy may be cut (proto.wire.clip)
        if isinstance(outcome, BaseException):
            try:  # the fleet remembers compile failures; a crash or a full disk is this host's
                self.claims.abandon(key, str(outcome) if isinstance(outcome, compiler.CompileFailed) else None, self.failure_ttl)
            except Exception:  # the answer below matters more
                log.exception("releasing the claim on %s failed", key[:16])
        self._finish(flight, outcome)

    def _put(self, flight: _Flight, built: _Built) -> Entry:
        """Publishes a build's files, counts it (a copy apart from compiles) and keeps the budget."""
        meta = built.meta
        entry = self.store.put(flight.key, built.staging, built.library, meta)
        if flight.derived:
            self.metrics.add(derived=1)
            log.info("published %s as a copy of the shared build %s", label(flight.spec), meta["shared_build"]["key"][:16])
        else:
            self.metrics.add(compiles=1, compile_seconds=meta["compile_seconds"], device_compile_seconds=meta["phases"]["device"])
            self.metrics.observe_compile(flight.spec.kind, meta["compile_seconds"], meta["phases"])
            phases = " ".join(f"{name} {seconds:.2f}" for name, seconds in meta["phases"].items())
            log.info("compiled %s in %.2f s (%s)", label(flight.spec), meta["compile_seconds"], phases)
        self.enforce_budget(protect=flight.key)
        return entry

    def _finish(self, flight: _Flight, outcome: Entry | BaseException, remember: float | None = None) -> None:
        """Answers every waiter of the flight with `outcome`. It leaves the in-flight table
        first: a later request then finds the entry on disk, or the remembered failure, kept
        `remember` seconds (default --failure-ttl; a cache write error is not remembered: it
        may clear)."""
        ttl = self.failure_ttl if remember is None else remember
        with self._lock:
            self._flights.remove(flight)
            if isinstance(outcome, compiler.CompileFailed) and ttl > 0:
                self._failures.remember(flight.key, outcome, ttl)
        settle(flight.future, outcome)

    def enforce_budget(self, protect: str | None = None) -> None:
        """Evicts down to the budget (after each publish, and once at start-up)."""
        try:
            self.store.evict(self.budget, protect)
        except OSError as exc:  # the budget is housekeeping: it never fails a request
            log.warning("eviction pass failed: %s", exc)

    # ----- shutdown
    def shutdown(self, grace: float) -> None:
        """Refuses new work, lets running compiles finish for up to `grace` seconds,
        then kills the workers. Queued jobs fail with ShuttingDown; no staging is left."""
        with self._lock:
            self._closing = True
            deferred, self._deferred = self._deferred, []
        for job in deferred:  # failed with ShuttingDown by the drivers, before their stop
            self._queue.put(job)
        self._warmup.stop()
        self._started.set()  # drivers that never started can stop
        for _ in self._drivers:
            self._queue.put(_Job(_STOP, next(self._seq)))
        deadline = time.monotonic() + grace
        for t in self._drivers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._drivers):
            log.warning("compiles still running after %.1fs grace; stopping the workers", grace)
            self._pool.kill()
            for t in self._drivers:
                t.join(10)
        self._publisher.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown()


def _empty(directory: Path) -> None:
    """Removes what a crashed build left in its staging directory."""
    for item in directory.iterdir():
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)
