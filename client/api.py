"""The client agents import: ask for kernels by signature, get loaded callables back."""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

import kernels
from proto import abi, channel, keys, manifest, wire
from proto.entry import Entry
from proto.memo import Memo
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import default_cache_dir, default_socket, entry_dir, service_info_file, socket_address
from proto.trust import layer_owner, read_owned
from proto.wire import Outcome, Status

from . import hit_reports, loader, resolver
from .errors import CompileError, CorruptArtifact, InvalidSpec, KernelNotReady, ServiceError, ServiceUnavailable
from .inductor import InductorCache, use_shared_inductor_cache
from .pending import PendingPrefetch

log = logging.getLogger(__name__)

GET_TIMEOUT = 600.0  # a cold kernel can wait behind a queue of compiles
STATS_TIMEOUT = 10.0
NO_DAEMON_WINDOW = 2.0  # how long UNAVAILABLE is retried when no daemon ever answered this client
RECONNECT_WINDOW = 30.0  # ... and once one has (a restart takes seconds)
SLOW_GET = 1.0  # a get_kernel that waits longer than this says why, at INFO
APP_ENV = "KERNEL_SERVICE_APP"  # the application name, when connect() is given none
STRICT_ENV = "KERNEL_SERVICE_STRICT"  # "1": strict, when connect() is not told


def spec_to_proto(spec: kernels.CanonicalSpec) -> pb.KernelSpec:
    return wire.spec_to_proto(spec.kind, spec.params, str(spec.target))


def _raise_for(err: grpc.RpcError, what: str, address: str = "", waited: float | None = None):
    raise channel.error_for(err, what, address, waited) from None


class Client:
    """A connection to the kernel service.

    `fallback=True` compiles in this process, into the same cache, when no
    daemon answers (it then needs TileLang; a file lock per kernel still makes
    it compile once across processes).

    A kernel already in the cache is found and loaded without a call to the
    daemon (its key computed here from the fingerprint the daemon reports
    once); `direct_hits=False` asks the daemon every time. When the daemon goes
    away, calls are retried for `reconnect_window` seconds (a restart), or for
    2 s if no daemon ever answered this client, then raise ServiceUnavailable.
    `app`: this application's name (default $KERNEL_SERVICE_APP): the daemon
    records every kernel it asks for, for `kernel-service manifest --app`; such
    a client asks the daemon for every kernel (once per process), so that it
    sees them all. `strict=True` (default: $KERNEL_SERVICE_STRICT=1): nothing
    compiles for this client; a kernel not in the cache raises KernelNotReady
    at once.

    Trust: the daemon must run as `daemon_uid` (default $KERNEL_SERVICE_DAEMON_UID, else
    this process's uid). On a Unix socket that is checked before the first call: the
    socket's directory must be a real directory of that uid that others cannot write,
    and the listening process's uid (SO_PEERCRED) must be it; else UntrustedService.
    Over TCP every call carries the daemon's token, read from `token_file` (default
    $KERNEL_SERVICE_TOKEN_FILE, else tcp-token under the default cache root), over TLS
    when `tls_ca` (default $KERNEL_SERVICE_TLS_CA) names the CA (PEM) that signed the
    daemon's --tls-cert. Either
    way kernels are loaded only from files of that uid under the cache root the daemon
    reports (see loader).
    """

    def __init__(
        self,
        socket: str | os.PathLike | None = None,
        *,
        fallback: bool = False,
        cache_dir: str | os.PathLike | None = None,
        timeout: float = GET_TIMEOUT,
        reconnect_window: float = RECONNECT_WINDOW,
        direct_hits: bool = True,
        app: str | None = None,
        strict: bool | None = None,
        daemon_uid: int | None = None,
        token_file: str | os.PathLike | None = None,
        tls_ca: str | os.PathLike | None = None,
    ):
        app = app or os.environ.get(APP_ENV)
        self.app = manifest.check_app(app) if app else ""
        self.strict = strict if strict is not None else os.environ.get(STRICT_ENV, "") == "1"
        self.address = socket_address(socket or default_socket())
        # The socket file, when the address is one: its absence means "no daemon" at once.
        self.socket_path = Path(self.address[len("unix:") :]) if self.address.startswith("unix:") else None
        self.fallback = fallback
        self.cache_dir = cache_dir
        self.timeout = timeout
        self.reconnect_window = reconnect_window
        self.direct_hits = direct_hits and not self.app  # a recorded application's every kernel goes by the daemon
        self._service: _Service | None = None  # GetServiceInfo, asked once: default target, cache root, key fingerprint
        self.daemon_uid = channel.daemon_uid(daemon_uid)
        self.token_file = Path(token_file) if token_file else None
        self._metadata: tuple | None = None  # TCP: the authorization header, read once
        self._trusted = False  # Unix socket: directory and peer uid checked
        self._channel = channel.open_channel(self.address, tls_ca)
        self._stub = pb_grpc.KernelServiceStub(self._channel)
        self._memo: dict[str, loader.Kernel] = {}
        self._memo_lock = threading.Lock()
        self._answered = False  # has a daemon ever answered this client?
        self._unreported_hits: collections.deque = collections.deque()  # one item per direct hit not yet reported (hit_reports)
        self._report_lock = threading.Lock()  # between the reporter thread, close() and exit; never on the hit path
        hit_reports.watch(self)

    def close(self) -> None:
        self.report_hits()
        self._channel.close()

    def report_hits(self) -> None:
        """Sends the direct hits not yet reported to the daemon in one ReportUsage (Stats.hits and
        direct_hits); best effort: those a daemon did not take wait for the next report."""
        with self._report_lock:
            count = 0
            while self._unreported_hits:  # only reporters pop, under the lock; hits append meanwhile
                self._unreported_hits.popleft()
                count += 1
            if not count or (self.socket_path is not None and not self.socket_path.exists()):
                self._unreported_hits.extend([None] * count)
                return
            try:
                self._stub.ReportUsage(pb.UsageReport(direct_hits=count), timeout=hit_reports.REPORT_TIMEOUT, metadata=self._auth())
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:  # not taken (no daemon, or it is stopping): the next report
                    self._unreported_hits.extend([None] * count)
                log.debug("direct hits not reported: %s", exc)
            except (OSError, ServiceError, ValueError) as exc:  # a TCP token that cannot be read; a closed client
                log.debug("direct hits not reported: %s", exc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- transport
    def _check_socket(self) -> None:
        if not self._answered and self.socket_path is not None and not self.socket_path.exists():
            raise ServiceUnavailable(f"no kernel service at {self.socket_path} (start one with `kernel-service serve`)")

    def _verify_daemon(self) -> None:
        """Before the first call on a Unix socket: the daemon's checks (proto.channel.verify_daemon)."""
        if self._trusted or self.socket_path is None:
            return
        channel.verify_daemon(self.socket_path, self.daemon_uid)
        self._trusted = True

    def _auth(self) -> tuple | None:
        """gRPC metadata for every call: over TCP, the daemon's token."""
        if self.socket_path is not None:
            return None
        if self._metadata is None:
            self._metadata = channel.auth_metadata(self.address, self.token_file)
        return self._metadata

    def _call(self, method: Callable, request, timeout: float, what: str):
        """One RPC; retries UNAVAILABLE (and a drain's CANCELLED) with backoff, and nothing else.

        The retry window (reconnect_window once a daemon answered this client, else 2 s) opens
        at the first failure and is not cut by `timeout`: each attempt may wait `timeout` seconds
        for its answer, or until the window closes if that is later (a restarted daemon is slow
        to give its first answers), so a call takes at most the window plus `timeout`. (Cut by
        a 10 s stats or service-info deadline, the documented 30 s window held about 9 s.)
        With no socket at all and no daemon ever seen, fails fast.
        """
        start = time.monotonic()
        retry_until = None
        delay = 0.05
        while True:
            self._check_socket()
            try:
                self._verify_daemon()
                wait = timeout if retry_until is None else max(timeout, retry_until - time.monotonic())
                result = method(request, timeout=wait, metadata=self._auth())
                self._answered = True
                return result
            except (grpc.RpcError, channel.NotListening) as err:
                now = time.monotonic()
                if retry_until is None:  # the window opens at the first failure and never slides
                    retry_until = now + (self.reconnect_window if self._answered else NO_DAEMON_WINDOW)
                code = err.code() if isinstance(err, grpc.RpcError) else Status.UNAVAILABLE
                if code not in Status.RETRYABLE or now + delay >= retry_until:
                    if isinstance(err, channel.NotListening):
                        tried = f" (retried for {now - start:.1f} s)" if now - start > 0.01 else ""
                        raise ServiceUnavailable(
                            f"no kernel service answers at {self.socket_path}{tried}: nothing accepts connections ({err}); start one with `kernel-service serve`"
                        ) from None
                    _raise_for(err, what, self.address, now - start)
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
            None (default): the daemon's default target (its --target; with no
            daemon and fallback, "auto"); "auto": the local GPU's arch ("sm_90a"
            on Hopper), else "c"; "c" (the CPU); or a CUDA arch ("sm_90a", ...).
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
            process, no RPC). A kernel already in the cache is found there,
            with no RPC either (see Client).

        Raises
        ------
        InvalidSpec (a ValueError; .field names the culprit), CompileError,
        KernelNotReady (not in the cache, and this client is strict or the daemon
        serves only), ServiceUnavailable (a ConnectionError), ServiceError,
        CorruptArtifact.
        """
        memo_key, proto, spec = self._request(kind, params, target)
        if spec is not None and kernels.get_kind(spec.kind).artifact != "service":
            raise InvalidSpec("kind", f"{kind!r} kernels are TileLang's own: compile them with TileLang's API after client.install_tilelang_cache()")
        kernel = self._memo.get(memo_key)
        if kernel is not None:
            return kernel
        started = time.monotonic()
        try:
            key = self._key(spec) if spec is not None and self.direct_hits else None
            kernel = self._from_cache(key, spec) if key else None
            if kernel is None:
                request = pb.GetKernelRequest(spec=proto, app=self.app, no_compile=self.strict)
                reply = self._call(self._stub.GetKernel, request, timeout or self.timeout, f"kernel {kind}")
                try:
                    kernel = self._load(reply, spec)
                except CorruptArtifact:
                    # Tell the daemon, which re-hashes the entry and removes it if it is corrupt,
                    # then ask once more: the answer is then a fresh build (or the same error).
                    self._report_corrupt(reply.artifact.key)
                    reply = self._call(self._stub.GetKernel, request, timeout or self.timeout, f"kernel {kind}")
                    kernel = self._load(reply, spec)
                if key and kernel.key != key:  # the daemon's toolchain changed (a new daemon): ask again next time
                    self._service = None
        except ServiceUnavailable:
            if not self.fallback or spec is None:
                raise
            from .fallback import build_locally

            kernel = build_locally(spec, self.cache_dir, compile=not self.strict)
        self._load_routes(kernel, timeout)
        waited = time.monotonic() - started
        if waited > SLOW_GET:  # a silent pause gets a reason
            how = (
                f"a copy of a shared build compiled in {kernel.shared_build['compile_seconds']:.1f} s"
                if kernel.shared_build
                else f"compile {kernel.compile_seconds:.1f} s"
            )
            log.info("get_kernel(%s) waited %.1f s: %s (%s)", kind, waited, kernel.outcome, how)
        return self._keep(memo_key, kernel)

    def _keep(self, memo_key: str, kernel: loader.Kernel) -> loader.Kernel:
        """A freshly loaded kernel, bound to its kind's torch op, memoized: the kernel this client
        returns for `memo_key` from now on (the first one kept, if two threads loaded it)."""
        from . import torch_ops  # imports torch, which loading the kernel has already done

        torch_ops.bind(kernel)
        with self._memo_lock:
            return self._memo.setdefault(memo_key, kernel)

    def _load_routes(self, router: loader.Kernel, timeout: float | None) -> None:
        """Loads the builds of a router (abi.dispatch) through this client: the last range's now
        (every range falls back to it), the others in the background, from the cache or else
        prefetched (the daemon makes them after every request's builds; calls in their ranges
        run the last range's build until then, and `router.ready()` waits for them). A strict
        client loads every one now, so that no call compiles or loads."""

        def get(spec: dict) -> loader.Kernel:
            return self.get_kernel(spec["kind"], target=spec["target"], timeout=timeout, **spec["params"])

        if self.strict:
            router.load_routes(get)
            return

        def later(specs: list[dict]) -> list:
            return self.prefetch([{"kind": s["kind"], "target": s["target"], **s["params"]} for s in specs], timeout=timeout, later=True)

        try:
            router.load_routes(self._at_hand, later)
        except ServiceUnavailable:  # no daemon (a router built by the fallback): each build now, as get_kernel gets it
            router.load_routes(get)

    def _at_hand(self, spec: dict) -> loader.Kernel | None:
        """The kernel of a canonical spec if this client has it or finds it in the cache at once
        (a hit without a round trip), else None."""
        if spec["kind"] not in kernels.kinds():  # a kind only the daemon knows: asked of it
            return None
        canonical = kernels.canonicalize(spec["kind"], spec["params"], spec["target"])
        memo_key = canonical.to_json()
        kernel = self._memo.get(memo_key)
        if kernel is None and self.direct_hits:
            key = self._key(canonical)
            kernel = self._from_cache(key, canonical) if key else None
            if kernel is not None:
                kernel = self._keep(memo_key, kernel)
        return kernel

    def _request(self, kind: str, params: dict, target: str | None) -> tuple[str, pb.KernelSpec, kernels.CanonicalSpec | None]:
        """(memo key, wire spec, canonical spec) of a request. Kinds this process knows are validated
        here, with the daemon's default target for `target=None`; others (a plugin the daemon serves,
        which the agent never imports) go as given, and the daemon validates them."""
        if kind in kernels.kinds():
            spec = kernels.canonicalize(kind, params, target if target is not None else self._default_target())
            return spec.to_json(), spec_to_proto(spec), spec
        if not isinstance(kind, str) or not isinstance(params, dict):
            raise InvalidSpec("kind", f"expected a kind name and a mapping of parameters, got {kind!r}")
        params = {name: kernels.spec.plain_any(value) for name, value in params.items()}  # torch.float16 -> "float16", ...
        proto = wire.spec_to_proto(kind, params, target)
        return proto.SerializeToString(deterministic=True).hex(), proto, None

    def _info(self) -> _Service:
        """The daemon's ServiceInfo, asked once; with no daemon answering, the one it left in the
        cache root (recorded_service_info), so that the kernels the cache holds still load;
        else raises ServiceUnavailable."""
        if self._service is None:  # on get_kernel's path, which waits as long as a compile may
            try:
                info = self.service_info(timeout=self.timeout)
            except ServiceUnavailable:
                info = self.recorded_service_info()
                if info is None:
                    raise
            self._service = _Service(info, self.daemon_uid)
        return self._service

    def recorded_service_info(self) -> dict | None:
        """The ServiceInfo the daemon left in its cache root (`cache_dir`, else
        $KERNEL_SERVICE_CACHE_DIR, else the default), read only from a file of the daemon's uid
        that no one else may write; None when there is none or it fails that check."""
        path = service_info_file(Path(self.cache_dir) if self.cache_dir else default_cache_dir())
        try:
            info = json.loads(read_owned(path, self.daemon_uid))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # refused (another owner, writable by others) or garbage
            log.warning("not using %s: %s", path, exc)
            return None
        if not isinstance(info, dict) or Path(str(info.get("cache_dir", ""))).resolve() != path.parent.resolve():
            log.warning("not using %s: it names another cache root", path)
            return None
        return info

    def _default_target(self) -> str:
        try:
            return self._info().info["default_target"] or "auto"
        except ServiceUnavailable:
            if self.fallback:  # compiled here: this host's default
                return "auto"
            raise

    def _key(self, spec: kernels.CanonicalSpec) -> str | None:
        """The key the daemon files `spec` under (proto.keys), from the fingerprint it reports;
        None when it reports none for this kind."""
        service = self._info()
        text = spec.to_json()
        if text in service.keys:
            return service.keys[text]
        fingerprint = service.fingerprint
        covered = spec.kind in fingerprint.get("kind_sources", {})
        key = keys.cache_key(text, keys.toolchain(fingerprint, spec.kind, spec.target.kind)) if covered else None
        if len(text) <= 4096:  # a program's spec is not kept: too large
            service.keys.remember(text, key)
        return key

    def _cached_entry(self, key: str, wanted: dict) -> tuple[Entry, int] | None:
        """A hit without a round trip: the entry the daemon published under `key` for the spec
        `wanted`, found and its records checked here, in the cache root, then in each layer, with
        the uid its files belong to. In the cache root its directory's mtime is set so the
        daemon's eviction counts the use (a layer is never written). None: ask the daemon."""
        roots = self._info().roots
        for root, owner in roots:
            found = loader.find_published(root, key, wanted, owner)
            if found is not None:
                break
        else:
            return None
        if root == roots[0][0]:
            try:
                os.utime(found.path)  # the clock eviction reads: this entry is in use
            except PermissionError:  # a group member cannot: the daemon must see this process's uses
                self.direct_hits = False
                return None
            except FileNotFoundError:  # evicted since: ask the daemon
                return None
        hit_reports.count(self)  # a hit the daemon never sees: counted here, reported off this path
        return found, owner

    def _from_cache(self, key: str, spec: kernels.CanonicalSpec) -> loader.Kernel | None:
        """The kernel of a hit without a round trip (_cached_entry), loaded; None: ask the daemon."""
        found = self._cached_entry(key, json.loads(spec.to_json()))
        return loader.open_published(*found) if found is not None else None

    def find(self, spec: kernels.CanonicalSpec) -> tuple[Entry, int] | None:
        """The published entry of a canonical spec and the uid its files belong to, found in the
        cache without a round trip (its records checked, as entry() checks them); None: not there,
        or this client asks the daemon for everything (an `app`, direct_hits=False)."""
        key = self._key(spec) if self.direct_hits else None
        return self._cached_entry(key, json.loads(spec.to_json())) if key else None

    def entry(self, spec: kernels.CanonicalSpec, *, timeout: float | None = None) -> tuple[Entry, int, str]:
        """The published entry of a canonical spec, with the uid its files belong to and how it was
        had ("hit", "compiled", "joined"), without loading it: found in the cache with no round
        trip where it can be, else asked of the daemon (recorded for `app`; compiled unless
        strict). Its records are checked as a kernel's are (loader.find_published); the caller
        checks the files it reads. Raises as get_kernel does (KernelNotReady, CompileError,
        ServiceUnavailable, ...), with no fallback."""
        wanted = json.loads(spec.to_json())
        key = self._key(spec) if self.direct_hits else None
        found = self._cached_entry(key, wanted) if key else None
        if found is not None:
            return (*found, Outcome.HIT.label)
        request = pb.GetKernelRequest(spec=spec_to_proto(spec), app=self.app, no_compile=self.strict)
        for attempt in range(2):
            reply = self._call(self._stub.GetKernel, request, timeout or self.timeout, kernels.label(spec))
            a = reply.artifact
            root, owner = next(((r, o) for r, o in self._info().roots if Path(a.entry_dir) == entry_dir(r, a.key)), (None, None))
            found = loader.find_published(root, a.key, wanted, owner) if root is not None else None
            if found is not None:
                if key and found.key != key:  # the daemon's toolchain changed (a new daemon): ask again next time
                    self._service = None
                return found, owner, Outcome.from_proto(reply.outcome)
            if attempt == 0:  # the daemon re-hashes it and removes it if corrupt; asked again, it rebuilds
                self._report_corrupt(a.key)
        raise CorruptArtifact(f"the daemon's entry {a.entry_dir} for {kernels.label(spec)} fails its checks, after it was rebuilt")

    def report_local_compiles(self, count: int) -> None:
        """Tells the daemon that `count` TileLang kernels compiled in this process instead
        (Stats.local_compiles); best effort: a daemon that does not answer is not waited for."""
        try:
            self._stub.ReportUsage(pb.UsageReport(local_compiles=count), timeout=STATS_TIMEOUT, metadata=self._auth())
        except (grpc.RpcError, OSError, ServiceError) as exc:
            log.debug("local compiles not reported: %s", exc)

    def _report_corrupt(self, key: str) -> None:
        try:
            self._call(self._stub.ReportCorrupt, pb.ReportCorruptRequest(key=key), STATS_TIMEOUT, "report corrupt")
        except (ServiceError, ServiceUnavailable, InvalidSpec):
            pass  # best effort: the retry then reports what it finds

    def _load(self, reply: pb.GetKernelResponse, spec: kernels.CanonicalSpec | None) -> loader.Kernel:
        """Loads what the daemon named, from its cache root or a layer only, as the spec asked for (a kind
        this process does not know is checked against the spec the daemon sent)."""
        a = reply.artifact
        roots = self._info().roots
        # The root it lies in (the cache root or a layer); elsewhere, the load refuses it.
        root, owner = next(((r, o) for r, o in roots if Path(a.entry_dir) == entry_dir(r, a.key)), roots[0])
        asked = json.loads(spec.to_json() if spec is not None else a.canonical_spec)
        b = reply.shared_build if reply.HasField("shared_build") else None
        record = loader.KernelRecord(
            loader.answered(a.key, Path(a.entry_dir), a.library, a.library_sha256, a.library_size, asked, json.loads(a.abi_json)),
            Outcome.from_proto(reply.outcome),
            reply.compile_seconds,
            {"key": b.key, "spec": json.loads(b.canonical_spec), "compile_seconds": b.compile_seconds} if b is not None else None,
        )
        return loader.load(record, root=root, owner=owner)

    def prefetch(
        self,
        specs: Iterable[dict] | str | os.PathLike | dict,
        *,
        timeout: float | None = None,
        progress: Callable[..., object] | None = None,
        load: bool = True,
        later: bool = False,
        wait: bool = True,
    ) -> list | PendingPrefetch:
        """Makes many kernels ready at once (cold ones compile in parallel).

        `specs` are dicts like {"kind": "gemm", "M": 128, ..., "target": "c"}, or a
        manifest (`kernel-service manifest`): its path, or the loaded dict.

        Returns one slot per spec, in request order: the loaded Kernel (with load=False, and
        for a TileLang program, which TileLang loads: its outcome, "hit", "compiled" or
        "joined"), or the exception that spec met, as
        get_kernel would raise it (InvalidSpec, its field named "specs[i]....", CompileError,
        KernelNotReady, ServiceError, CorruptArtifact): one bad spec fails its own slot
        only. A strict client compiles nothing: what is not in the cache comes back as
        KernelNotReady. Raises only for the whole batch (ServiceUnavailable; ServiceError
        for a passed deadline or a full queue).

        `progress` is called in this thread once per spec, as each finishes (invalid specs
        first); what it returns is ignored. It takes one, two or three positional arguments:
        progress(event), progress(done, total) or progress(done, total, event). `done` and
        `total` count specs; `event` is a dict with the spec's `index` in `specs`, `done`,
        `total`, and either `kernel` (the daemon's answer: outcome, artifact, compile_seconds,
        shared_build) or `error_code` (a gRPC status name: "INVALID_ARGUMENT" for an invalid
        spec, "FAILED_PRECONDITION" for a failed compile, "NOT_FOUND" for not ready) and
        `error_message`.

        `later=True` asks for kernels this process can do without for now (a router's other
        ranges): the daemon compiles them after every other request's builds, from any process.

        `wait=False` sends the batch and returns at once a PendingPrefetch, whose `result()` is
        this list: called first thing, before `import torch`, it has the daemon build while the
        process imports (neither sending nor the daemon's building needs torch here).
        """
        if isinstance(specs, (str, os.PathLike, dict)):
            specs = manifest.specs(specs)
        if not wait:
            _progress_reporter(progress)  # a callback of the wrong shape raises now, not at result()
            return PendingPrefetch(self.prefetch, list(specs), {"timeout": timeout, "progress": progress, "load": load, "later": later})
        report = _progress_reporter(progress)
        specs = list(specs)
        results: list = [None] * len(specs)
        done = 0

        def refuse(slot: int, exc: InvalidSpec) -> None:  # an invalid spec: its slot's answer, reported as finished
            nonlocal done
            results[slot], done = exc, done + 1
            report(pb.PrefetchEvent(index=slot, done=done, total=len(results), error_code=Status.INVALID_SPEC.name, error_message=str(exc)))

        wanted = []  # (slot in results, memo key, wire spec, canonical spec) of each valid spec
        for i, raw in enumerate(specs):
            if isinstance(raw, kernels.CanonicalSpec):  # validated already (client.tilelang's programs)
                wanted.append((i, raw.to_json(), spec_to_proto(raw), raw))
                continue
            raw = dict(raw)
            try:
                wanted.append((i, *self._request(raw.pop("kind", None), raw, raw.pop("target", None))))
            except InvalidSpec as exc:
                refuse(i, _in_batch(exc, i))
        # The daemon refuses a whole batch for one spec it finds invalid (a kind only it knows):
        # that spec leaves the batch, which is sent again.
        while (refused := self._prefetch_batch(wanted, results, done, timeout, report, load, later)) is not None:
            slot, exc = refused
            wanted = [w for w in wanted if w[0] != slot]
            refuse(slot, exc)
        for i, kernel in enumerate(results):  # a router's builds, loaded as get_kernel loads them (every one is built by now)
            if isinstance(kernel, loader.Kernel):
                try:
                    self._load_routes(kernel, timeout)
                except (CorruptArtifact, CompileError, ServiceError, KernelNotReady) as exc:
                    results[i] = exc
        return results

    def _prefetch_batch(self, wanted: list, results: list, done: int, timeout: float | None, report, load: bool, later: bool) -> tuple[int, InvalidSpec] | None:
        """One Prefetch of the `wanted` specs, each answer put in its slot of `results` and reported
        (`done` of them reported before). Returns (slot, InvalidSpec) when the daemon refused the
        batch for that one spec before answering any, else None; raises for the whole batch."""
        request = pb.PrefetchRequest(specs=[proto for _, _, proto, _ in wanted], app=self.app, no_compile=self.strict, later=later)
        answered = 0

        def opened(request, timeout, metadata):  # retried by _call until the daemon answers (its first event, or a refusal)
            stream = self._stub.Prefetch(request, timeout=timeout, metadata=metadata)
            try:
                return next(stream, None), stream, None
            except grpc.RpcError as err:
                if err.code() in Status.RETRYABLE:
                    raise
                return None, stream, err

        first, stream, refusal = self._call(opened, request, timeout or self.timeout, "prefetch")
        try:
            if refusal is not None:
                raise refusal
            for event in itertools.chain([first] if first is not None else [], stream):
                answered += 1
                slot, memo_key, proto, spec = wanted[event.index]
                if event.error_code:
                    results[slot] = channel.event_error(event, f"kernel {proto.kind}")
                elif load and json.loads(event.kernel.artifact.abi_json).get("loader") != abi.PROGRAM:  # TileLang loads its programs (client.tilelang)
                    results[slot] = self._load_prefetched(event.kernel, memo_key, proto, spec, timeout)
                else:
                    results[slot] = Outcome.from_proto(event.kernel.outcome)
                event.index, event.done, event.total = slot, done + event.done, len(results)
                report(event)
        except grpc.RpcError as err:
            refused = channel.refused_spec(err, len(wanted)) if not answered else None
            if refused is None:
                _raise_for(err, "prefetch", self.address)
            position, exc = refused
            slot = wanted[position][0]
            return slot, _in_batch(exc, slot)
        return None

    def _load_prefetched(self, reply: pb.GetKernelResponse, memo_key: str, proto: pb.KernelSpec, spec, timeout: float | None):
        """The kernel a Prefetch event names, loaded and kept; or the exception loading it met."""
        try:
            kernel = self._load(reply, spec)
        except CorruptArtifact:  # reported, then fetched again once (see get_kernel)
            self._report_corrupt(reply.artifact.key)
            try:
                kernel = self._load(self._call(self._stub.GetKernel, pb.GetKernelRequest(spec=proto), timeout or self.timeout, f"kernel {proto.kind}"), spec)
            except (CorruptArtifact, CompileError, ServiceError) as exc:
                return exc
        return self._keep(memo_key, kernel)

    def validate(self, kind: str, *, target: str | None = None, **params) -> None:
        """Raises InvalidSpec when this process finds the spec invalid (a kind only the daemon knows
        is checked there, when asked for). Compiles nothing; with `target` given, asks the daemon nothing."""
        self._request(kind, params, target)

    def explain(self, kind: str, *, target: str | None = None, **params) -> dict:
        """Whether the kernel is in the cache, and why not: {"hit", "key", "spec", "toolchain"
        (each part of the fingerprint), "reason", "failure" (the full text of a compile failure
        the daemon remembers for it, which a CompileError may carry cut; "" if none), "nearest":
        [{"key", "spec", "differences": [{"part", "field", "wanted", "found", "text"}]}]}.
        Compiles nothing."""
        _, proto, _ = self._request(kind, params, target)
        reply = self._call(self._stub.Explain, pb.ExplainRequest(spec=proto), STATS_TIMEOUT, f"explain {kind}")
        return wire.explanation_from_proto(reply)

    def service_info(self, *, timeout: float | None = None) -> dict:
        """Where the daemon keeps things and how it builds: cache_dir, inductor_dir, version, toolchain,
        default_target, cuda_compiler. `timeout`: seconds to wait (default 10; a daemon builds this
        answer once, after it starts, which can take seconds on a busy machine)."""
        reply = self._call(self._stub.GetServiceInfo, pb.GetServiceInfoRequest(), timeout or STATS_TIMEOUT, "service info")
        return {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    def use_shared_inductor_cache(self) -> InductorCache:
        """Points this process's torch.compile at the daemon's persistent Inductor directory
        and returns it with where it came from ("environment", "daemon" or "fallback").
        An existing TORCHINDUCTOR_CACHE_DIR wins; with no daemon, the directory is the one a
        daemon would use on this client's cache (cache_dir, else $KERNEL_SERVICE_CACHE_DIR,
        else the XDG default). Call it before the first torch.compile."""
        fallback_root = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        return use_shared_inductor_cache(lambda: self.service_info()["inductor_dir"], fallback_root)

    def kinds(self) -> list[dict]:
        """The kernel kinds the daemon serves (the zoo and its plugins), each with its `params`:
        name, type, doc, required, default, nullable, choices, min, max; and its `origin`."""
        reply = self._call(self._stub.ListKinds, pb.ListKindsRequest(), STATS_TIMEOUT, "list kinds")
        return [wire.kind_from_proto(k) for k in reply.kinds]

    def stats(self) -> dict:
        """The daemon's counters (compiles, hits, misses, failures, in_flight, workers, entries, bytes, ...)."""
        reply = self._call(self._stub.GetStats, pb.GetStatsRequest(), STATS_TIMEOUT, "stats")
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}  # native ints, unlike MessageToDict


class _Service:
    """The daemon's ServiceInfo and what this client derived from it, dropped together when the
    daemon turns out to have another toolchain (a new daemon)."""

    def __init__(self, info: dict, daemon_uid: int):
        self.info = info
        self.daemon_uid = daemon_uid
        self.keys = Memo()  # spec JSON -> the key the daemon files it under (None: not covered)

    @functools.cached_property
    def fingerprint(self) -> dict:
        """The key fingerprint (proto.keys) the daemon reports."""
        return json.loads(self.info.get("key_fingerprint_json") or "{}")

    @functools.cached_property
    def roots(self) -> tuple[tuple[Path, int], ...]:
        """Where the daemon's entries lie, in the order it looks them up, each with the uid its files
        belong to: the cache root (the daemon's uid), then each read-only layer (its root's owner:
        root or the daemon's uid). A layer that fails that check is left out: nothing is loaded
        from it."""
        roots = [(Path(self.info["cache_dir"]), self.daemon_uid)]
        for layer in self.info.get("cache_layers", ()):
            try:
                roots.append((Path(layer), layer_owner(layer, self.daemon_uid, "not loading from it")))
            except OSError as exc:
                log.warning("%s", exc.strerror or exc)
        return tuple(roots)


def _in_batch(exc: InvalidSpec, index: int) -> InvalidSpec:
    """An invalid spec's error, its field named by the spec's place in a batch ("specs[3].N")."""
    return InvalidSpec(f"specs[{index}].{exc.field}", str(exc).split(": ", 1)[-1])


def _progress_reporter(progress: Callable[..., object] | None) -> Callable[[pb.PrefetchEvent], None]:
    """prefetch's `progress` as a function of one event, in whichever of its three forms
    (event), (done, total), (done, total, event) it takes: its signature is read once."""
    if progress is None:
        return lambda event: None
    try:
        params = list(inspect.signature(progress).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): the full form
        params = None
    if params is None or any(p.kind == p.VAR_POSITIONAL for p in params):
        count = 3
    else:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        count = min(len(positional), 3)
        if count == 0 or len(required) > 3:
            raise TypeError(
                f"prefetch: progress must take 1 (event), 2 (done, total) or 3 (done, total, event) positional arguments; {progress!r} takes {len(required)}"
            )

    def report(event: pb.PrefetchEvent) -> None:
        if count == 2:
            progress(event.done, event.total)
            return
        as_dict = channel.reply_to_dict(event)
        if count == 1:
            progress(as_dict)
        else:
            progress(event.done, event.total, as_dict)

    return report


# ----- module-level API on a default connection
_default: Client | None = None
_default_lock = threading.Lock()


def connect(socket: str | os.PathLike | None = None, **options) -> Client:
    """A new client for the daemon at `socket` (default: $KERNEL_SERVICE_SOCKET or the XDG path);
    the options are Client's, with its defaults (see Client)."""
    return Client(socket, **options)


connect.__signature__ = inspect.signature(Client)  # help(connect) lists Client's options


def default_client() -> Client:
    global _default
    with _default_lock:
        if _default is None:
            _default = Client(fallback=os.environ.get("KERNEL_SERVICE_FALLBACK", "") == "1")
        return _default


def _resolve(kind: str, target: str, params: dict) -> loader.Kernel:
    return default_client().get_kernel(kind, target=target, **params)


resolver.set_resolver(_resolve)  # a spec no loaded kernel answers (a saved program's) comes from the default connection


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


def prefetch(specs: Iterable[dict], **options) -> list | PendingPrefetch:
    return default_client().prefetch(specs, **options)


def stats() -> dict:
    return default_client().stats()


def kinds() -> list[dict]:
    return default_client().kinds()


def explain(kind: str, *, target: str | None = None, **params) -> dict:
    return default_client().explain(kind, target=target, **params)


def use_shared_inductor_cache_default() -> InductorCache:
    return default_client().use_shared_inductor_cache()


__all__ = ["Client", "connect", "default_client", "explain", "get_kernel", "kinds", "prefetch", "stats", "use_shared_inductor_cache_default"]
