"""The gRPC servicer: proto in, domain calls, proto and status codes out. Nothing else."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading

import grpc

import kernels
from kernels.spec import InvalidSpec
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.wire import Outcome, Status

from . import __version__
from .build.compiler import CompileFailed
from .keys import describe_toolchain
from .metrics import Metrics
from .scheduler import BACKGROUND, URGENT, Cancelled, QueueFull, Scheduler, ShuttingDown, WorkerCrashed
from .store import Entry, StoreError
from .store.local import KEY

log = logging.getLogger(__name__)

VALID_MEMO = 4096  # validated specs remembered (a plain dict, cleared when full)


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
    return pb.GetKernelResponse(
        artifact=artifact,
        cached_result=outcome == Outcome.HIT,
        outcome=outcome.value,
        compile_seconds=float(entry.meta.get("compile_seconds", 0.0)),
    )


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a domain error maps to (proto.wire.Status; the proto's Errors lists)."""
    if isinstance(exc, InvalidSpec):
        return Status.INVALID_SPEC, wire.clip(wire.invalid_spec_details(exc))
    if isinstance(exc, CompileFailed):
        return Status.COMPILE_FAILED, wire.clip(str(exc))
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
        return Status.DEADLINE, "deadline passed while the kernel was compiling; it keeps compiling"
    log.exception("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"unexpected {type(exc).__name__}: {exc}"


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

    def release(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, None
        if futures:
            self._scheduler.release(futures)


class KernelServicer(pb_grpc.KernelServiceServicer):
    def __init__(self, scheduler: Scheduler, metrics: Metrics, info: dict):
        """`info`: the ServiceInfo fields (cache_dir, inductor_dir, default_target, ...)."""
        self.scheduler = scheduler
        self.metrics = metrics
        self.default_target = info["default_target"]
        self.info = pb.ServiceInfo(**info, version=__version__, toolchain=describe_toolchain(scheduler.device.id), cuda_compiler=scheduler.device.id)
        self._valid: dict[bytes, kernels.CanonicalSpec] = {}

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
        if len(self._valid) >= VALID_MEMO:
            self._valid.clear()
        self._valid[wire_bytes] = canonical
        return canonical

    def GetKernel(self, request, context):
        try:
            spec = self._validate(request.spec)
            future, outcome = self.scheduler.request(spec, URGENT)
            entry = future.result(timeout=context.time_remaining())
            return response(entry, outcome)
        except Exception as exc:  # noqa: BLE001 - every domain error becomes a status
            context.abort(*status_of(exc))

    def Prefetch(self, request, context):
        if len(request.specs) > wire.MAX_BATCH:
            context.abort(Status.INVALID_SPEC, f"specs: at most {wire.MAX_BATCH} per Prefetch, got {len(request.specs)}")
        # What this call waits for, given back when it ends: a cancelled Prefetch drops its
        # queued compiles that no one else waits for (context callbacks run on cancellation).
        claims = _Claims(self.scheduler)
        context.add_callback(claims.release)
        try:
            specs = []
            for i, raw in enumerate(request.specs):
                try:
                    specs.append(self._validate(raw))
                except InvalidSpec as exc:
                    raise InvalidSpec(f"specs[{i}].{exc.field}", str(exc).split(": ", 1)[-1]) from None
            pending = {}
            queued, share = 0, self.scheduler.call_share
            # Longest compiles first (the kinds' cost hints): the batch then ends with short ones filling the workers.
            for i, spec in sorted(enumerate(specs), key=lambda item: -kernels.get_kind(item[1].kind).compile_cost):
                future, outcome = self.scheduler.request(spec, BACKGROUND)
                if not future.done():
                    claims.add(future)
                    if outcome == Outcome.COMPILED and future not in pending:
                        queued += 1
                        if queued > share:  # one call takes a share of the queue, never all of it
                            raise QueueFull(
                                f"a Prefetch may queue at most {share} compiles (a quarter of the daemon's --queue-limit {self.scheduler.queue_limit}); "
                                f"this one needs more of its {len(specs)} kernels compiled: split it"
                            )
                pending[future] = pending.get(future, []) + [(i, outcome)]
        except Exception as exc:  # noqa: BLE001
            claims.release()  # all or nothing: what this call queued is given back
            context.abort(*status_of(exc))
        total, done = len(specs), 0
        try:
            for future in cf.as_completed(pending, timeout=context.time_remaining()):
                for index, outcome in pending[future]:
                    done += 1
                    event = pb.PrefetchEvent(index=index, done=done, total=total)
                    if future.exception() is None:
                        event.kernel.CopyFrom(response(future.result(), outcome))
                    else:
                        code, message = status_of(future.exception())
                        event.error_code, event.error_message = code.name, message
                    yield event
        except cf.TimeoutError as exc:
            context.abort(*status_of(exc))

    def ReportCorrupt(self, request, context):
        if not KEY.fullmatch(request.key):
            context.abort(Status.INVALID_SPEC, f"key: expected 64 lowercase hex characters, got {request.key[:80]!r}")
        reason = self.scheduler.store.recheck(request.key)
        return pb.ReportCorruptResponse(removed=reason is not None, reason=wire.clip(reason or ""))

    def GetStats(self, request, context):
        return pb.Stats(**self.metrics.read())

    def GetServiceInfo(self, request, context):
        return self.info

    def ListKinds(self, request, context):
        return pb.ListKindsResponse(kinds=[wire.kind_to_proto(kind.describe(), kernels.origin(name)) for name, kind in sorted(kernels.kinds().items())])
