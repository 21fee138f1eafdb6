"""The gRPC servicer: proto in, domain calls, proto and status codes out. Nothing else."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from pathlib import Path

import grpc

import kernels
from kernels.spec import InvalidSpec
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

from . import __version__, inductor
from .compiler import CompileFailed
from .keys import cuda_compiler_id, describe_toolchain
from .scheduler import BACKGROUND, URGENT, Outcome, QueueFull, Scheduler, ShuttingDown
from .store import Entry, StoreError

log = logging.getLogger(__name__)

MAX_ERROR_TEXT = 12_000
MAX_BATCH = 4096
# Far above any real signature, far below what could cost memory or time: checked
# before anything else, so hostile input never reaches validation messages or keys.
MAX_PARAMS = 64
MAX_NAME = 64  # kind, target and parameter names
MAX_STRING = 256  # string parameter values
VALID_MEMO = 4096  # validated specs remembered (a plain dict, cleared when full)


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"


def spec_from_proto(spec: pb.KernelSpec, default_target: str) -> kernels.CanonicalSpec:
    if len(spec.kind) > MAX_NAME:
        raise InvalidSpec("kind", f"at most {MAX_NAME} characters, got {_short(spec.kind)}")
    if len(spec.target) > MAX_NAME:
        raise InvalidSpec("target", f"at most {MAX_NAME} characters, got {_short(spec.target)}")
    if len(spec.params) > MAX_PARAMS:
        raise InvalidSpec("params", f"at most {MAX_PARAMS} parameters, got {len(spec.params)}")
    params = {}
    for name, value in spec.params.items():
        if len(name) > MAX_NAME:
            raise InvalidSpec("params", f"parameter names have at most {MAX_NAME} characters, got {_short(name)}")
        which = value.WhichOneof("value")
        if which == "string_value" and len(value.string_value) > MAX_STRING:
            raise InvalidSpec(name, f"string values have at most {MAX_STRING} characters, got {len(value.string_value)}")
        if which is None:
            raise InvalidSpec(name, "parameter sent with no value")
        params[name] = None if which == "null_value" else getattr(value, which)
    return kernels.canonicalize(spec.kind, params, spec.target or default_target)


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
        outcome=int(outcome),
        compile_seconds=float(entry.meta.get("compile_seconds", 0.0)),
    )


def _clip(text: str) -> str:
    if len(text) <= MAX_ERROR_TEXT:
        return text
    half = MAX_ERROR_TEXT // 2
    return f"{text[:half]}\n... [{len(text) - MAX_ERROR_TEXT} characters cut] ...\n{text[-half:]}"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a domain error maps to (see the proto's Errors lists)."""
    if isinstance(exc, InvalidSpec):
        return grpc.StatusCode.INVALID_ARGUMENT, _clip(str(exc))
    if isinstance(exc, CompileFailed):
        return grpc.StatusCode.FAILED_PRECONDITION, _clip(str(exc))
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, StoreError):
        return grpc.StatusCode.INTERNAL, f"kernel cache write failed: {exc.strerror or exc}"  # e.g. "No space left on device"
    if isinstance(exc, cf.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while the kernel was compiling; it keeps compiling"
    log.exception("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"unexpected {type(exc).__name__}: {exc}"


class KernelServicer(pb_grpc.KernelServiceServicer):
    def __init__(self, scheduler: Scheduler, default_target: str, cpu_quota: int, address: str, inductor_dir: Path):
        self.scheduler = scheduler
        self.inductor_dir = inductor_dir
        self.default_target = default_target
        self.cpu_quota = cpu_quota
        self.address = address
        self.started = time.time()
        self.invalid = 0
        self._invalid_lock = threading.Lock()
        self._valid: dict[bytes, kernels.CanonicalSpec] = {}

    def _validate(self, spec: pb.KernelSpec) -> kernels.CanonicalSpec:
        # Hits repeat the same few specs: remember the valid ones by their wire bytes.
        wire = spec.SerializeToString(deterministic=True)
        canonical = self._valid.get(wire)
        if canonical is not None:
            return canonical
        try:
            canonical = spec_from_proto(spec, self.default_target)
        except InvalidSpec:
            with self._invalid_lock:
                self.invalid += 1
            raise
        if len(self._valid) >= VALID_MEMO:
            self._valid.clear()
        self._valid[wire] = canonical
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
        if len(request.specs) > MAX_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"specs: at most {MAX_BATCH} per Prefetch, got {len(request.specs)}")
        try:
            specs = []
            for i, raw in enumerate(request.specs):
                try:
                    specs.append(self._validate(raw))
                except InvalidSpec as exc:
                    raise InvalidSpec(f"specs[{i}].{exc.field}", str(exc).split(": ", 1)[-1]) from None
            pending = {}
            # Longest compiles first (the kinds' cost hints): the batch then ends with short ones filling the workers.
            for i, spec in sorted(enumerate(specs), key=lambda item: -kernels.get_kind(item[1].kind).compile_cost):
                future, outcome = self.scheduler.request(spec, BACKGROUND)
                pending[future] = pending.get(future, []) + [(i, outcome)]
        except Exception as exc:  # noqa: BLE001
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

    def GetStats(self, request, context):
        c = self.scheduler.counters
        entries, size = self.scheduler.store.totals()
        inductor_entries, inductor_bytes = inductor.usage(self.inductor_dir)
        with c.lock:
            return pb.Stats(
                compiles=c.compiles,
                hits=c.hits,
                misses=c.misses,
                failures=c.failures,
                failures_cached=c.failures_cached,
                joined=c.joined,
                derived=c.derived,
                compile_seconds=c.compile_seconds,
                in_flight=self.scheduler.in_flight,
                workers=self.scheduler.workers,
                entries=entries,
                bytes=size,
                corrupt=self.scheduler.store.corrupt_found,
                evictions=self.scheduler.store.evicted,
                invalid=self.invalid,
                cpu_quota=self.cpu_quota,
                cache_dir=str(self.scheduler.store.root),
                address=self.address,
                uptime_seconds=time.time() - self.started,
                version=__version__,
                toolchain=describe_toolchain(self.scheduler.cuda_compiler),
                cuda_compiler=cuda_compiler_id(self.scheduler.cuda_compiler),
                device_compile_seconds=c.device_compile_seconds,
                inductor_dir=str(self.inductor_dir),
                inductor_entries=inductor_entries,
                inductor_bytes=inductor_bytes,
            )

    def GetServiceInfo(self, request, context):
        return pb.ServiceInfo(
            cache_dir=str(self.scheduler.store.root),
            inductor_dir=str(self.inductor_dir),
            version=__version__,
            toolchain=describe_toolchain(self.scheduler.cuda_compiler),
            default_target=self.default_target,
            cuda_compiler=cuda_compiler_id(self.scheduler.cuda_compiler),
        )
