"""The gRPC servicer: proto in, domain calls, proto and status codes out. Nothing else."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable

import grpc

import kernels
from kernels.spec import InvalidSpec
from proto import wire
from proto.entry import is_key
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.manifest import check_app
from proto.memo import Memo
from proto.wire import Outcome, Status

from . import __version__, explain, keys
from .apps import AppRecorder
from .build.compiler import CompileFailed
from .keys import describe_toolchain, toolchain
from .metrics import Metrics
from .scheduler import (
    BACKGROUND,
    LATER,
    MEMO_SPEC,
    URGENT,
    Cancelled,
    CompileTimeout,
    NotReady,
    QueueFull,
    Scheduler,
    ShuttingDown,
    SourceChanged,
    WorkerCrashed,
)
from .store import Entry, StoreError

log = logging.getLogger(__name__)

# Calls waiting on compiles or fetches from the fleet tier at once (GetKernel misses, Prefetch
# streams); more get BUSY at once. It bounds what idle and unread callers can hold; hits and
# health are never counted.
MAX_WAITING = 1024
MAX_REPORTED = 1_000_000  # a count one ReportUsage may add
SLOW_THREADS = 4  # the pool for the RPCs' slow parts (walking the store, stats probes): the loop never waits on them


def response(entry: Entry, outcome: Outcome) -> pb.GetKernelResponse:
    artifact = pb.KernelArtifact(
        key=entry.key,
        entry_dir=str(entry.path),
        library=entry.library,
        library_sha256=entry.library_sha256,
        library_size=entry.library_size,
        abi_json=entry.abi_json,
        canonical_spec=entry.spec_json,
    )
    reply = pb.GetKernelResponse(
        artifact=artifact,
        cached_result=outcome == Outcome.HIT,
        outcome=outcome.value,
        compile_seconds=float(entry.meta.get("compile_seconds", 0.0)),
    )
    shared = entry.meta.get("shared_build")
    if shared:  # a copy: say which build it copies, and what that build cost
        reply.shared_build.key = shared["key"]
        reply.shared_build.canonical_spec = json.dumps(shared["spec"], sort_keys=True, separators=(",", ":"))
        reply.shared_build.compile_seconds = float(shared["compile_seconds"])
    return reply


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a domain error maps to (proto.wire.Status; the proto's Errors lists)."""
    if isinstance(exc, InvalidSpec):
        return Status.INVALID_SPEC, wire.clip(wire.invalid_spec_details(exc))
    if isinstance(exc, CompileTimeout):  # a CompileFailed with a status of its own
        return Status.COMPILE_TIMEOUT, wire.clip(wire.COMPILE_TIMEOUT_DETAILS + str(exc))
    if isinstance(exc, (CompileFailed, SourceChanged)):
        return Status.COMPILE_FAILED, wire.clip(str(exc))
    if isinstance(exc, NotReady):
        return Status.NOT_READY, str(exc)
    if isinstance(exc, QueueFull):
        return Status.BUSY, str(exc)
    if isinstance(exc, ShuttingDown):
        return Status.UNAVAILABLE, str(exc)
    if isinstance(exc, WorkerCrashed):
        return Status.CRASHED, str(exc)
    if isinstance(exc, Cancelled):
        return Status.DROPPED, str(exc)
    if isinstance(exc, StoreError):
        return Status.CACHE_FAILED, f"kernel cache write failed: {exc.strerror or exc}"  # e.g. "No space left on device"
    if isinstance(exc, cf.TimeoutError):
        return Status.DEADLINE, "deadline passed first; a compile already running goes on, a queued one no other caller waits for is dropped"
    log.exception("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"unexpected {type(exc).__name__}: {exc}"


def explanation_to_proto(e: explain.Explanation) -> pb.ExplainResponse:
    def value(v) -> str:
        return json.dumps(None if v is explain.MISSING else v)

    reply = pb.ExplainResponse(hit=e.hit, key=e.key, canonical_spec=json.dumps(e.spec, sort_keys=True), reason=e.reason)
    reply.toolchain.update({name: json.dumps(v) for name, v in e.toolchain.items()})
    for near in e.nearest:
        n = reply.nearest.add(key=near.key, canonical_spec=json.dumps(near.spec, sort_keys=True))
        for d in near.differences:
            n.differences.add(part=d.part, field=d.field, wanted=value(d.wanted), found=value(d.found), text=d.text)
    return reply


class _Claims:
    """The in-flight futures one Prefetch call waits for, released exactly once."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._futures: list[cf.Future] | None = []
        self._lock = threading.Lock()

    def add(self, future: cf.Future) -> None:
        with self._lock:
            if self._futures is not None:
                self._futures.append(future)
                return
        self._scheduler.release([future])  # the call ended while its batch was being requested

    def release(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, None
        if futures:
            self._scheduler.release(futures)


class Waiting:
    """Counts the calls that wait on compiles or on fetches from the fleet tier (a GetKernel
    miss, a Prefetch) and refuses more than `limit` at once with BUSY: the bound on what idle
    or unread callers can hold. Hits and health checks never wait, so they are never counted
    or refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self.now = 0

    @contextlib.contextmanager
    def slot(self):
        if self.now >= self.limit:  # only the event loop's thread counts: no lock
            raise QueueFull(f"the daemon has {self.now} calls waiting for compiles or the fleet tier, its limit; retry later")
        self.now += 1
        try:
            yield
        finally:
            self.now -= 1


async def _result(future: cf.Future, timeout: float | None):
    """The future's result, awaited on the event loop (no thread held). On timeout raises
    cf.TimeoutError and leaves the future alone: other callers may share its compile."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake(_):
        with contextlib.suppress(RuntimeError):  # the loop closed: the daemon stopped, no one waits
            loop.call_soon_threadsafe(lambda: ready.done() or ready.set_result(None))

    future.add_done_callback(wake)
    try:
        await asyncio.wait_for(ready, timeout)
    except asyncio.TimeoutError:
        raise cf.TimeoutError from None
    return future.result()


def _completions(futures: list[cf.Future]) -> asyncio.Queue:
    """A queue the futures are put on as each completes (its callback may run in any thread)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Queue = asyncio.Queue()

    def put(future):
        with contextlib.suppress(RuntimeError):  # the loop closed: the daemon stopped, no one reads
            loop.call_soon_threadsafe(done.put_nowait, future)

    for future in futures:
        future.add_done_callback(put)
    return done


class KernelServicer(pb_grpc.KernelServiceServicer):
    """The RPCs as coroutines on the daemon's one event loop: a waiting or unread call holds
    no thread. What is quick runs inline (validation, a hit's lookup); what may take long
    (walking the store, the first ServiceInfo, the counters' probes) runs in a small pool
    of its own threads, so the loop never waits on it; a compile, or a fetch from the fleet
    tier, runs on the scheduler's threads and is awaited."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, info: dict, apps: AppRecorder, zero_stats=None):
        """`info`: the ServiceInfo fields (cache_dir, inductor_dir, default_target, config_json, ...);
        `apps`: where the specs each named application asks for are recorded;
        `zero_stats()`: what ZeroStats does (zero the counters and save them)."""
        self.scheduler = scheduler
        self.metrics = metrics
        self.apps = apps
        self.default_target = info["default_target"]
        self.zero_stats = zero_stats or metrics.zero
        self.waiting = Waiting(MAX_WAITING)
        self._slow = cf.ThreadPoolExecutor(SLOW_THREADS, thread_name_prefix="rpc-slow")
        self._info_fields = info
        self._info: pb.ServiceInfo | None = None
        self._info_lock = threading.Lock()
        self._valid: Memo = Memo()  # wire bytes -> canonical spec

    def close(self) -> None:
        self._slow.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._slow, fn, *args)

    @property
    def info(self) -> pb.ServiceInfo:
        """Built once, after SERVING (the daemon's housekeeping asks first): the kinds' source
        digests and the toolchain take a moment, seconds on a busy machine. A caller that comes
        while it is being built waits for that build instead of making a second one."""
        with self._info_lock:
            if self._info is None:
                device = self.scheduler.device.id
                fingerprint = json.dumps(keys.fingerprint(device), sort_keys=True)
                self._info = pb.ServiceInfo(
                    **self._info_fields, version=__version__, toolchain=describe_toolchain(device), cuda_compiler=device, key_fingerprint_json=fingerprint
                )
            return self._info

    def _validate(self, spec: pb.KernelSpec) -> kernels.CanonicalSpec:
        # Hits repeat the same few specs: remember the valid ones by their encoding. Unknown
        # fields are dropped first (RequestGuard already did; this keeps the memo safe without
        # it): a key is then only what validation bounds (names, values, at most 64 params),
        # never megabytes a caller attached.
        spec.DiscardUnknownFields()
        wire_bytes = spec.SerializeToString(deterministic=True)
        canonical = self._valid.get(wire_bytes)
        if canonical is not None:
            return canonical
        try:
            kind, params, target = wire.spec_from_proto(spec)
            canonical = kernels.canonicalize(kind, params, target or self.default_target)
        except InvalidSpec:
            self.metrics.add(invalid=1)
            raise
        if len(wire_bytes) <= MEMO_SPEC:  # a TileLang program (tens of kilobytes) is validated each time
            self._valid.remember(wire_bytes, canonical)
        return canonical

    async def _validated(self, spec: pb.KernelSpec) -> kernels.CanonicalSpec:
        """_validate, off the loop for a large spec (a program's IR takes milliseconds to check)."""
        return self._validate(spec) if spec.ByteSize() <= MEMO_SPEC else await self._off_loop(self._validate, spec)

    def _app(self, app: str) -> str | None:
        """The checked application name of a request, or None when it names none."""
        try:
            return check_app(app) if app else None
        except InvalidSpec:
            self.metrics.add(invalid=1)
            raise

    def _explain(self, spec: kernels.CanonicalSpec, key: str, records=None) -> explain.Explanation:
        return explain.explain(self.scheduler.store, spec, key, toolchain(spec.kind, spec.target.kind, self.scheduler.device.id), records)

    def _explained(self, exc: NotReady, records=None) -> NotReady:
        """A NotReady with its reason completed by Explain's nearest entries (a walk of the store;
        run it off the loop). `records()`: the store's entries, read once for a batch of misses."""
        reason = self._explain(exc.spec, exc.key, records() if records else None).reason
        return NotReady(exc.spec, exc.key, f"{exc.why}; {reason}")

    async def GetKernel(self, request, context):
        start = time.perf_counter()
        try:
            app = self._app(request.app)
            spec = await self._validated(request.spec)
            if app:
                self.apps.record(app, spec.to_json())
            future, outcome = self.scheduler.request(spec, URGENT, compile=not request.no_compile)
            try:
                if future.done():
                    entry = future.result()
                else:
                    with self.waiting.slot():  # a compile, or a fetch from the fleet tier (a miss that may not compile)
                        try:
                            entry = await _result(future, context.time_remaining())
                        finally:  # cancelled, or past its deadline: a queued compile no one else waits for is dropped
                            if not future.done():
                                self.scheduler.release([future])
            except NotReady as exc:  # its reason completed off the loop
                raise await self._off_loop(self._explained, exc) from None
            reply = response(entry, outcome)
        except Exception as exc:  # noqa: BLE001 - every domain error becomes a status
            code, message = status_of(exc)
            self.metrics.observe("request_duration_seconds", code.name.lower(), time.perf_counter() - start)
            await context.abort(code, message)
        self.metrics.observe("request_duration_seconds", outcome.label, time.perf_counter() - start)
        return reply

    def _plan(self, request, claims: _Claims) -> tuple[int, dict, Callable]:
        """Validates a Prefetch's specs and requests each; returns their number, the futures
        to wait for, each with the (index, outcome) of the specs it answers, and `records()`,
        the store's entries read once for the batch's NotReady explanations."""
        app = self._app(request.app)
        specs = []
        for i, raw in enumerate(request.specs):
            try:
                specs.append(self._validate(raw))
            except InvalidSpec as exc:
                raise InvalidSpec(f"specs[{i}].{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if app:
            for spec in specs:
                self.apps.record(app, spec.to_json())
        pending = {}
        records = functools.cache(lambda: list(self.scheduler.store.records()))
        queued, share = 0, self.scheduler.call_share
        compiles = not request.no_compile and self.scheduler.compiles  # else a miss is a fetch, never a queued compile
        priority = LATER if request.later else BACKGROUND
        # Longest compiles first (the kinds' cost hints): the batch then ends with short ones filling the workers.
        for i, spec in sorted(enumerate(specs), key=lambda item: -kernels.get_kind(item[1].kind).compile_cost):
            future, outcome = self.scheduler.request(spec, priority, compile=not request.no_compile)
            if not future.done():
                claims.add(future)
                if compiles and outcome == Outcome.COMPILED and future not in pending:
                    queued += 1
                    if queued > share:  # one call takes a share of the queue, never all of it
                        raise QueueFull(
                            f"a Prefetch may queue at most {share} compiles (a quarter of the daemon's --queue-limit {self.scheduler.queue_limit}); "
                            f"this one needs more of its {len(specs)} kernels compiled: split it"
                        )
            pending[future] = pending.get(future, []) + [(i, outcome)]
        return len(specs), pending, records

    async def Prefetch(self, request, context):
        if len(request.specs) > wire.MAX_BATCH:
            await context.abort(Status.INVALID_SPEC, f"specs: at most {wire.MAX_BATCH} per Prefetch, got {len(request.specs)}")
        # What this call waits for, given back when it ends: a cancelled Prefetch drops its
        # queued compiles that no one else waits for (done callbacks run on cancellation too).
        claims = _Claims(self.scheduler)
        context.add_done_callback(lambda _: claims.release())
        try:
            with self.waiting.slot():
                total, pending, records = await self._off_loop(self._plan, request, claims)  # validating a batch, a lookup each: not on the loop
                done = 0
                completions = _completions(list(pending))
                remaining = context.time_remaining()
                deadline = None if remaining is None else time.monotonic() + remaining
                for _ in range(len(pending)):
                    future = await asyncio.wait_for(completions.get(), None if deadline is None else max(0.0, deadline - time.monotonic()))
                    error = future.exception()
                    if isinstance(error, NotReady):  # reported in its own event, like a failed compile, its reason completed off the loop
                        error = await self._off_loop(self._explained, error, records)
                    for index, outcome in pending[future]:
                        done += 1
                        event = pb.PrefetchEvent(index=index, done=done, total=total)
                        if error is None:
                            event.kernel.CopyFrom(response(future.result(), outcome))
                        else:
                            code, message = status_of(error)
                            event.error_code, event.error_message = code.name, message
                        yield event  # an unread stream waits here, on HTTP/2 flow control: it stalls no one else
        except asyncio.TimeoutError:
            await context.abort(*status_of(cf.TimeoutError()))
        except Exception as exc:  # noqa: BLE001
            claims.release()  # all or nothing: what this call queued is given back
            await context.abort(*status_of(exc))

    async def ReportCorrupt(self, request, context):
        if not is_key(request.key):
            await context.abort(Status.INVALID_SPEC, f"key: expected 64 lowercase hex characters, got {request.key[:80]!r}")
        reason = await self._off_loop(self.scheduler.store.recheck, request.key)
        return pb.ReportCorruptResponse(removed=reason is not None, reason=wire.clip(reason or ""))

    async def ReportUsage(self, request, context):
        for name in ("local_compiles", "direct_hits"):
            if not 0 <= getattr(request, name) <= MAX_REPORTED:
                self.metrics.add(invalid=1)
                await context.abort(Status.INVALID_SPEC, f"{name}: expected 0 to {MAX_REPORTED}, got {getattr(request, name)}")
        # A client's direct hits are hits: the hit ratio (hits / (hits + misses)) counts them.
        self.metrics.add(local_compiles=request.local_compiles, hits=request.direct_hits, direct_hits=request.direct_hits)
        return pb.UsageReportResponse()

    def _stats(self) -> pb.Stats:
        return pb.Stats(**self.metrics.read())

    async def GetStats(self, request, context):
        return await self._off_loop(self._stats)  # the probes read the disk (cache usage)

    def _zero(self) -> pb.Stats:
        before = self._stats()
        self.zero_stats()
        return before

    async def ZeroStats(self, request, context):
        return await self._off_loop(self._zero)  # RequestGuard let only the owner's secret through

    async def GetServiceInfo(self, request, context):
        return self._info or await self._off_loop(lambda: self.info)

    async def Explain(self, request, context):
        try:
            spec = await self._validated(request.spec)
        except Exception as exc:  # noqa: BLE001
            await context.abort(*status_of(exc))
        key = self.scheduler.key_of(spec)
        reply = explanation_to_proto(await self._off_loop(self._explain, spec, key))
        reply.failure = self.scheduler.remembered_failure(key) or ""  # in full: GetKernel's details are cut (wire.clip)
        return reply

    def _kinds(self) -> pb.ListKindsResponse:
        return pb.ListKindsResponse(kinds=[wire.kind_to_proto(kind.describe(), kernels.origin(name)) for name, kind in sorted(kernels.kinds().items())])

    async def ListKinds(self, request, context):
        return await self._off_loop(self._kinds)
