"""The client agents import: ask for kernels by signature, get loaded callables back."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from google.protobuf import json_format

import kernels
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import default_socket, default_token_file, socket_address
from proto.wire import Outcome, Status

from . import loader
from .errors import CompileError, InvalidSpec, ServiceError, ServiceUnavailable
from .inductor import InductorCache, use_shared_inductor_cache

GET_TIMEOUT = 600.0  # a cold kernel can wait behind a queue of compiles
STATS_TIMEOUT = 10.0
RETRY_WINDOW = 30.0  # how long UNAVAILABLE is retried once a daemon has answered


def spec_to_proto(spec: kernels.CanonicalSpec) -> pb.KernelSpec:
    return wire.spec_to_proto(spec.kind, spec.params, str(spec.target))


def _raise_for(err: grpc.RpcError, what: str):
    code, details = err.code(), err.details() or ""
    if code == Status.INVALID_SPEC:
        raise wire.invalid_spec_from_details(details) from None
    if code == Status.COMPILE_FAILED:
        raise CompileError(f"{what} failed to compile:\n{details}") from None
    if code == Status.UNAVAILABLE:
        raise ServiceUnavailable(f"kernel service unavailable: {details}") from None
    raise ServiceError(f"{what}: {code.name}: {details}", code.name) from None


def _request(kind: str, params: dict, target: str | None) -> tuple[str, pb.KernelSpec, kernels.CanonicalSpec | None]:
    """(memo key, wire spec, canonical spec) of a request. Kinds this process knows are validated
    here; others (a plugin the daemon serves, which the agent never imports) go as given and the
    daemon validates them."""
    if kind in kernels.kinds():
        spec = kernels.canonicalize(kind, params, target)
        return spec.to_json(), spec_to_proto(spec), spec
    if not isinstance(kind, str) or not isinstance(params, dict):
        raise InvalidSpec("kind", f"expected a kind name and a mapping of parameters, got {kind!r}")
    params = {name: kernels.spec.plain_any(value) for name, value in params.items()}  # torch.float16 -> "float16", ...
    proto = wire.spec_to_proto(kind, params, target)
    return proto.SerializeToString(deterministic=True).hex(), proto, None


class Client:
    """A connection to the kernel service.

    `fallback=True` compiles in this process, into the same cache, when no
    daemon answers (it then needs TileLang; a file lock per kernel still makes
    it compile once across processes).

    Over TCP every call carries the daemon's token, read from `token_file` (default
    $KERNEL_SERVICE_TOKEN_FILE, else tcp-token under the default cache root).
    """

    def __init__(
        self,
        socket: str | os.PathLike | None = None,
        *,
        fallback: bool = False,
        cache_dir: str | os.PathLike | None = None,
        timeout: float = GET_TIMEOUT,
        token_file: str | os.PathLike | None = None,
    ):
        self.address = socket_address(socket or default_socket())
        # The socket file, when the address is one: its absence means "no daemon" at once.
        self.socket_path = Path(self.address[len("unix:"):]) if self.address.startswith("unix:") else None
        self.fallback = fallback
        self.cache_dir = cache_dir
        self.timeout = timeout
        self.token_file = Path(token_file) if token_file else None
        self._metadata: tuple | None = None  # TCP: the authorization header, read once
        self._channel = grpc.insecure_channel(self.address, options=wire.channel_options())
        self._stub = pb_grpc.KernelServiceStub(self._channel)
        self._memo: dict[str, loader.Kernel] = {}
        self._memo_lock = threading.Lock()
        self._answered = False  # has a daemon ever answered this client?

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- transport
    def _check_socket(self) -> None:
        if not self._answered and self.socket_path is not None and not self.socket_path.exists():
            raise ServiceUnavailable(f"no kernel service at {self.socket_path} (start one with `kernel-service serve`)")

    def _auth(self) -> tuple | None:
        """gRPC metadata for every call: over TCP, the daemon's token."""
        if self.socket_path is not None:
            return None
        if self._metadata is None:
            path = self.token_file or default_token_file()
            try:
                token = path.read_text().strip()
            except OSError as exc:
                raise ServiceUnavailable(f"kernel service at {self.address}: cannot read the daemon's TCP token from {path} ({exc.strerror}); pass token_file= or set KERNEL_SERVICE_TOKEN_FILE") from None
            self._metadata = (("authorization", f"Bearer {token}"),)
        return self._metadata

    def _call(self, method: Callable, request, timeout: float, what: str):
        """One RPC with a deadline; retries UNAVAILABLE (and a drain's CANCELLED) with backoff, and nothing else.

        With no socket at all and no daemon ever seen, fails fast.
        """
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            self._check_socket()
            try:
                result = method(request, timeout=max(0.001, deadline - time.monotonic()), metadata=self._auth())
                self._answered = True
                return result
            except grpc.RpcError as err:
                retry_until = min(deadline, time.monotonic() + (RETRY_WINDOW if self._answered else 2.0))
                if err.code() not in Status.RETRYABLE or time.monotonic() + delay >= retry_until:
                    _raise_for(err, what)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)

    # ----- API
    def get_kernel(self, kind: str, *, target: str | None = None, timeout: float | None = None, **params) -> loader.Kernel:
        """A served kernel, compiled once per host, loaded and callable on torch tensors.

            gemm = client.get_kernel("gemm", M=None, N=14336, K=4096, dtype=torch.float16, trans_b=True)
            C = gemm(A, W)                 # A: [M, 4096], W: [14336, 4096] -> C: [M, 14336]
            gemm(A, W, out=C)              # into a preallocated C

        Parameters
        ----------
        kind : str
            The kernel family: one of the kinds listed below.
        target : str, optional
            "auto" (default: the local GPU's arch, e.g. "sm_90a" on Hopper, else "c"),
            "c" (the CPU), or a CUDA arch ("sm_90a", "sm_80", ...).
        timeout : float, optional
            Seconds to wait for the daemon, a cold compile included (default 600).
        **params
            The kind's parameters, listed below. Sizes are ints (numpy integers
            too; never bools); a size given as None is a runtime size, so one
            kernel serves every value (a batch). dtype is "float16", "bfloat16"
            or "float32", or the torch.dtype / numpy.dtype of that name.
            Tiling parameters default per target.

        Returns
        -------
        client.Kernel
            Call it with the input tensors in the order below (contiguous, on
            the target's device): it returns the output, allocated with
            torch.empty on the current stream, or writes into `out=`.
            `k.__doc__` and `inspect.signature(k)` give its inputs' shapes
            and dtypes; `k.spec` its canonical signature. Kernels are
            inference-only: an input that requires grad while grad mode is on
            raises RuntimeError. Under torch.compile and torch.export a call is
            the custom op torch.ops.kernel_service.<kind>, traced with no graph
            break. The same signature returns the same object (memoized per
            process, no RPC).

        Raises
        ------
        InvalidSpec (a ValueError; .field names the culprit), CompileError,
        ServiceUnavailable (a ConnectionError), ServiceError, CorruptArtifact.
        """
        memo_key, proto, spec = _request(kind, params, target)
        kernel = self._memo.get(memo_key)
        if kernel is not None:
            return kernel
        try:
            reply = self._call(self._stub.GetKernel, pb.GetKernelRequest(spec=proto), timeout or self.timeout, f"kernel {kind}")
        except ServiceUnavailable:
            if not self.fallback or spec is None:
                raise
            from .fallback import build_locally

            kernel = build_locally(spec, self.cache_dir)
        else:
            kernel = self._load(reply)
        with self._memo_lock:
            return self._memo.setdefault(memo_key, kernel)

    def _load(self, reply: pb.GetKernelResponse) -> loader.Kernel:
        a = reply.artifact
        kernel = loader.load(Path(a.entry_dir), a.library, a.library_sha256, a.library_size, json.loads(a.abi_json), json.loads(a.canonical_spec), a.key)
        kernel.outcome = Outcome.from_proto(reply.outcome)
        kernel.compile_seconds = reply.compile_seconds
        return kernel

    def prefetch(self, specs: Iterable[dict], *, timeout: float | None = None, progress: Callable[[int, int, dict], None] | None = None, load: bool = True) -> list:
        """Makes many kernels ready at once (cold ones compile in parallel).

        `specs` are dicts like {"kind": "gemm", "M": 128, ..., "target": "c"}.
        Returns, in request order, the loaded Kernel (or, with load=False, the
        outcome string) or the exception for each spec. `progress(done, total,
        event)` is called as each finishes.
        """
        canon = []
        for i, raw in enumerate(specs):
            raw = dict(raw)
            try:
                canon.append(_request(raw.pop("kind", None), raw, raw.pop("target", None)))
            except InvalidSpec as exc:
                raise InvalidSpec(f"specs[{i}].{exc.field}", str(exc).split(": ", 1)[-1]) from None
        request = pb.PrefetchRequest(specs=[proto for _, proto, _ in canon])
        results: list = [None] * len(canon)
        self._check_socket()
        try:
            for event in self._stub.Prefetch(request, timeout=timeout or self.timeout, metadata=self._auth()):
                if event.error_code:
                    exc = CompileError(event.error_message) if event.error_code == "FAILED_PRECONDITION" else ServiceError(event.error_message, event.error_code)
                    results[event.index] = exc
                elif load:
                    kernel = self._load(event.kernel)
                    with self._memo_lock:
                        results[event.index] = self._memo.setdefault(canon[event.index][0], kernel)
                else:
                    results[event.index] = Outcome.from_proto(event.kernel.outcome)
                if progress:
                    progress(event.done, event.total, json_format.MessageToDict(event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
        except grpc.RpcError as err:
            _raise_for(err, "prefetch")
        return results

    def service_info(self) -> dict:
        """Where the daemon keeps things and how it builds: cache_dir, inductor_dir, version, toolchain, default_target, cuda_compiler."""
        reply = self._call(self._stub.GetServiceInfo, pb.GetServiceInfoRequest(), STATS_TIMEOUT, "service info")
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    def use_shared_inductor_cache(self) -> InductorCache:
        """Points this process's torch.compile at the daemon's persistent Inductor directory
        and returns it with where it came from ("environment", "daemon" or "fallback").
        An existing TORCHINDUCTOR_CACHE_DIR wins. Call it before the first torch.compile."""
        return use_shared_inductor_cache(lambda: self.service_info()["inductor_dir"])

    def kinds(self) -> list[dict]:
        """The kernel kinds the daemon serves (the zoo and its plugins), each with its `params`:
        name, type, doc, required, default, nullable, choices, min, max; and its `origin`."""
        reply = self._call(self._stub.ListKinds, pb.ListKindsRequest(), STATS_TIMEOUT, "list kinds")
        return [wire.kind_from_proto(k) for k in reply.kinds]

    def stats(self) -> dict:
        """The daemon's counters (compiles, hits, misses, failures, in_flight, workers, entries, bytes, ...)."""
        reply = self._call(self._stub.GetStats, pb.GetStatsRequest(), STATS_TIMEOUT, "stats")
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}  # native ints, unlike MessageToDict


# ----- module-level API on a default connection
_default: Client | None = None
_default_lock = threading.Lock()


def connect(socket: str | os.PathLike | None = None, **options) -> Client:
    """A new client for the daemon at `socket` (default: $KERNEL_SERVICE_SOCKET or the XDG path).

    Options: fallback, cache_dir, timeout, token_file (see Client)."""
    return Client(socket, **options)


def default_client() -> Client:
    global _default
    with _default_lock:
        if _default is None:
            _default = Client(fallback=os.environ.get("KERNEL_SERVICE_FALLBACK", "") == "1")
        return _default


def get_kernel(kind: str, *, target: str | None = None, timeout: float | None = None, **params) -> loader.Kernel:
    return default_client().get_kernel(kind, target=target, timeout=timeout, **params)


def _kinds_doc() -> str:
    """The kinds and their parameters, from their schemas: the tail of get_kernel's docstring."""
    lines = ["", "Kinds", "-----"]
    for name, kind in sorted(kernels.kinds().items()):
        params = []
        for p in kind.params:
            text = p.name if p.default is kernels.spec.REQUIRED else f"{p.name}={p.default!r}"
            params.append(text)
        lines.append(f"{name}({', '.join(params)})")
        lines.append(f"    {kind.doc}")
        for p in kind.params:
            if p.doc:
                lines.append(f"    {p.name}: {p.doc}")
    return "\n".join("        " + line if line else "" for line in lines) + "\n"


Client.get_kernel.__doc__ += _kinds_doc()
get_kernel.__doc__ = Client.get_kernel.__doc__


def prefetch(specs: Iterable[dict], **options) -> list:
    return default_client().prefetch(specs, **options)


def stats() -> dict:
    return default_client().stats()


def kinds() -> list[dict]:
    return default_client().kinds()


def use_shared_inductor_cache_default() -> InductorCache:
    return default_client().use_shared_inductor_cache()


__all__ = ["Client", "connect", "default_client", "get_kernel", "kinds", "prefetch", "stats", "use_shared_inductor_cache_default"]
