"""Loads a published cache entry into a callable, without TileLang.

The entry's rules are the contract's (proto.entry), and so are the safe reads
(proto.trust); a refusal they raise reaches the caller as CorruptArtifact. Only
what the daemon's uid wrote under the cache root the daemon reported is loaded (or what a
read-only cache layer it reported holds, whose files are all its root's owner's: root or the
daemon's uid): the entry directory must be <root>/entries/<key[:2]>/<key>, each of
those directories a real one (lstat: no symlink) owned by that uid and
not writable by group or others. entry.json there must record the spec asked
for and the ABI the daemon sent (so a server that lies cannot make a client
call a real library with another kernel's shapes). The shared object is opened
once and checked through that one descriptor (regular file, not a symlink,
owned by the daemon's uid, not group/world-writable, the size and sha256 the
daemon published). The bytes
that were hashed are the bytes loaded: they are written to a uniquely named
file in a private (0700) directory of this process and dlopened from there,
so nothing can be swapped between check and load. (Loading through
/proc/self/fd/N is not safe: the dynamic loader matches libraries by path
name, and descriptor numbers are reused.)

Two loaders, chosen by the entry's ABI:
  "c":       TileLang's C target: a plain `int call(T* tensors..., int dims...)`
             loaded with ctypes.
  "tvm_ffi": CUDA kernels: a TVM-FFI module taking DLPack tensors. Its cubin
             loader lives in TileLang's libtvm_runtime.so, which is dlopened
             directly; the TileLang Python package is never imported.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib.util
import inspect
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proto import abi as abi_schema
from proto.entry import ENTRY_META, MANIFEST, Entry, EntryRefused, check_location, is_file_name, read_manifest, read_meta, signature
from proto.memo import Memo
from proto.paths import entry_dir, xdg_cache_home
from proto.trust import read_owned, read_verified  # noqa: F401  (importable from here, as before)

from . import checks, fastcall
from .errors import CorruptArtifact, LoadError

log = logging.getLogger(__name__)

_CHECKED = fastcall.CHECKED  # a fast call's answer: take the checked path

_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}
_C_INTS = {"int32": ctypes.c_int32, "int64": ctypes.c_int64}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


@contextlib.contextmanager
def as_corrupt():
    """The contract's refusals (proto.entry, proto.trust), and a file gone meanwhile, raised as
    the client's CorruptArtifact: the caller reports the entry and asks again."""
    try:
        yield
    except CorruptArtifact:
        raise
    except EntryRefused as exc:
        raise CorruptArtifact(str(exc)) from None
    except FileNotFoundError as exc:
        raise CorruptArtifact(f"cannot open {exc.filename}: {exc.strerror}") from None


def entry_directory(root: Path, entry_dir: Path, key: str, owner: int) -> Path:
    """`entry_dir` if it is where the cache at `root` keeps entry `key`, and it and every
    directory from `root` down are real directories of `owner` that no one else may write
    (proto.entry.check_location); raises CorruptArtifact."""
    with as_corrupt():
        return check_location(root, entry_dir, key, owner)


def _exec_candidates() -> list[Path]:
    """Where a private copy may go, in order: the temporary directory ($TMPDIR), then
    $XDG_RUNTIME_DIR, then the user's cache directory (~/.cache): containers often mount
    /tmp noexec, and a library there cannot be mapped."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    out = [Path(tempfile.gettempdir())]
    if runtime and os.path.isabs(runtime):
        out.append(Path(runtime))
    out.append(xdg_cache_home())
    return list(dict.fromkeys(out))


NOEXEC_FIX = "set TMPDIR to a directory on a filesystem mounted without noexec (e.g. TMPDIR=$HOME/.cache/tmp), or remount it with exec"


@functools.cache
def _private_dir() -> Path:
    """A private (0700) directory of this process, on a filesystem that lets a library in it be
    mapped executable: found at the first load, the first of _exec_candidates that is not
    mounted noexec. Raises LoadError, naming the fix, when none is."""
    tried = []
    for base in _exec_candidates():
        try:
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
            if os.statvfs(base).f_flag & os.ST_NOEXEC:
                tried.append(f"{base} (mounted noexec)")
                continue
            path = Path(tempfile.mkdtemp(prefix=f"kernel-service-load-{os.getpid()}-", dir=base))
        except OSError as exc:
            tried.append(f"{base} ({exc.strerror or exc})")
            continue
        atexit.register(shutil.rmtree, path, True)  # each loaded copy is unlinked at once; this removes the directory
        return path
    raise LoadError(f"cannot load kernels: no directory to copy them to lets a library be executed, tried {', '.join(tried)}; {NOEXEC_FIX}")


_names = itertools.count()


def dlopen_bytes(data: bytes, key: str, opener, keep: bool = False):
    """opener(path) on a private copy of `data` under a name never used before in this process.
    The copy is unlinked once opened (the mapping outlives the name), unless `keep`: TileLang's
    JITKernel reads its library's path again (its autotuner copies it into its own cache); the
    private directory goes at exit."""
    path = _private_dir() / f"{key[:16]}-{next(_names)}.so"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o500)
    opened = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        result = opener(str(path))
        opened = True
        return result
    except OSError as exc:  # mapped executable refused on a filesystem statvfs did not flag (a policy, an overlay)
        if "failed to map segment" in str(exc):
            raise LoadError(f"cannot load kernel {key[:16]} from {path}: {exc}; {NOEXEC_FIX}") from None
        raise
    finally:
        if not (keep and opened):
            path.unlink(missing_ok=True)


class _Refused:
    """A meta path finder refusing module `name` to imports made on the thread that made it."""

    def __init__(self, name: str):
        self.name, self.thread = name, threading.get_ident()

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None  # not ours to find: the next finder looks


@functools.cache
def _tvm_runtime():
    """tvm_ffi, and TileLang's native libraries, not its Python package (~30 ms, against seconds):
    libtvm_runtime.so registers TVM's CUDA module loader, libtilelang.so the host-side
    helpers CUDA kernels call at launch (e.g. TMA descriptor creation)."""
    import sys

    import torch  # noqa: F401  (TileLang loads torch first too: shared CUDA libraries resolve against it)

    # tvm_ffi imports ml_dtypes, when it can, only to name numpy's 8- and 16-bit float dtypes, and
    # that import can cost more than the rest of a first kernel's load (docs/measured.md#warm-start).
    # Without it tvm_ffi names those dtypes by their numpy names, which are the same. The refusal
    # is this thread's only: another thread's import of ml_dtypes meanwhile goes through.
    refusal = _Refused("ml_dtypes")
    sys.meta_path.insert(0, refusal)
    try:
        import tvm_ffi
    finally:
        sys.meta_path.remove(refusal)

    spec = importlib.util.find_spec("tilelang")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("TileLang's runtime library is needed to load CUDA kernels: pip install tilelang")
    libs = Path(next(iter(spec.submodule_search_locations))) / "lib"
    for name in ("libtvm_runtime.so", "libtilelang.so"):
        ctypes.CDLL(str(libs / name), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    return tvm_ffi


INFERENCE_ONLY = (
    "kernel-service kernels are inference-only (no autograd formula): input {name} of {kind} requires grad "
    "while grad mode is on; call it under torch.inference_mode() or torch.no_grad(), or pass {name}.detach()"
)


def _spec_json(spec: dict) -> str:
    """The canonical spec's JSON, as kernels.CanonicalSpec.to_json() writes it."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def _sizes(t) -> tuple:
    """t's shape for messages: symbolic sizes (a tensor being traced) as the values they stand for."""
    out = []
    for d in t.shape:
        hint = getattr(getattr(d, "node", None), "hint", None)
        out.append(int(hint) if hint is not None else d)
    return tuple(out)


def _shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@dataclass(frozen=True)
class KernelRecord:
    """What a Kernel is built from: its entry, and how it was had (from the daemon's answer, a
    direct hit in the cache, or a compile in this process without a daemon)."""

    entry: Entry  # where its files are; its meta holds (at least) the spec and ABI
    outcome: str = "hit"  # or "compiled", "joined"
    compile_seconds: float = 0.0
    shared_build: dict | None = None  # for a copy of a shared build: that build's key, spec and compile seconds

    @classmethod
    def published(cls, found: Entry) -> KernelRecord:
        """A hit found in the cache without a round trip (find_published): its entry.json says the rest."""
        return cls(found, compile_seconds=float(found.meta.get("compile_seconds", 0.0)), shared_build=found.meta.get("shared_build"))


def answered(key: str, path: Path, library: str, sha256: str, size: int, spec: dict, abi: dict) -> Entry:
    """The entry an answer names (the daemon's reply, the embedded service's): `spec` (the spec
    asked for) and `abi` are what its entry.json must record, which load() checks."""
    return Entry(key, Path(path), library, sha256, size, {"spec": spec, "abi": abi})


def _loaded(got):
    """A Kernel, or the exception met instead of it raised."""
    if isinstance(got, BaseException):
        raise got
    return got


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _route_build(spec: dict, kernel: Kernel) -> Kernel:
    """`kernel`, checked as the build a router names for `spec`."""
    if "dispatch" in kernel.abi or kernel.spec != spec:
        raise CorruptArtifact(f"a {spec['kind']} router names a build that is not one: {json.dumps(spec, sort_keys=True)[:200]}")
    return kernel


class Kernel:
    """A loaded kernel. Call it with the input tensors (in signature order); it
    allocates and returns the output (or a tuple of outputs), or writes into
    `out=`. Each instance's own `__doc__` and `inspect.signature` name its
    inputs with their shapes and dtypes (`help()` on an instance shows this
    class; read `k.__doc__`).

    Under torch.compile and torch.export, and for inputs that are not plain
    tensors (fake or meta tensors), a call goes through the torch custom op
    `torch.ops.kernel_service.<kind>` (see client/torch_ops.py); otherwise it
    calls the library directly. Both check the inputs the same way.
    """

    def __init__(self, fn, record: KernelRecord, keepalive=None):
        self._fn = fn
        self._keepalive = keepalive  # the ctypes library must outlive its functions
        self.record = record
        entry = record.entry
        self.abi = abi = entry.abi
        self.spec = entry.meta["spec"]
        self.spec_json = _spec_json(self.spec)
        self.key = entry.key
        self.path = entry.path / entry.library
        self.kind = self.spec["kind"]
        self._routes: list[tuple[int | None, Kernel]] | None = None  # a router's builds by range (abi.dispatch): load_routes
        self._loading: threading.Thread | None = None  # a router's builds loading in the background
        self._loading_error: BaseException | None = None
        params = abi["params"]
        self._outputs = abi["outputs"]
        self._scratch = abi.get("scratch", [])  # workspaces allocated per call, never returned
        self._inputs = [i for i in range(len(params)) if i not in self._outputs and i not in self._scratch]
        self._dtypes = [_torch_dtype(p["dtype"]) for p in params]
        self._lock = threading.Lock() if abi["loader"] == "c" else None
        self.input_names = [params[i]["name"] for i in self._inputs]
        self.output_names = [params[i]["name"] for i in self._outputs]
        self.writes = [params[i]["name"] for i in abi.get("writes", [])]  # inputs updated in place
        self.inplace = self._inplace_slots()
        self.__doc__, self.__signature__ = self._describe()
        self._check_metadata = checks.rule_for(self.kind)  # checked mode (KERNEL_SERVICE_CHECK=1): index inputs validated
        self._fast = None if self._check_metadata else fastcall.make(self)  # None: every call takes the checked path
        self._op = self._op_out = None  # kernel_service::<kind> and its .out: bound by the client after loading (torch_ops.bind)
        self.op_unbound = "a kernel from client.get_kernel has one"  # why no op is bound, when none is

    # ----- where it came from (its record)
    @property
    def outcome(self) -> str:
        """How it was obtained: "hit", "compiled" or "joined"."""
        return self.record.outcome

    @property
    def compile_seconds(self) -> float:
        return self.record.compile_seconds

    @property
    def shared_build(self) -> dict | None:
        """For a copy of a shared build: that build's key, spec and compile seconds."""
        return self.record.shared_build

    # ----- the torch op (client/torch_ops.py binds it)
    def bind_op(self, op, op_out) -> None:
        """Calls under torch.compile / torch.export go through `op` (kernel_service::<kind>) and `op_out` (its .out)."""
        self._op, self._op_out = op, op_out

    def leave_unbound(self, why: str) -> None:
        """No op can be bound (`why`): plain calls still run, traced ones raise saying why."""
        self.op_unbound = why

    def empty_outputs(self, dims: dict, device) -> list:
        """The outputs for the runtime sizes `dims`, allocated with torch.empty on `device` (current stream)."""
        import torch

        return [torch.empty(shape, dtype=self._dtypes[slot], device=device) for slot, shape in zip(self._outputs, self.output_shapes(dims))]

    def __repr__(self) -> str:
        return f"<Kernel {self.kind} {json.dumps(self.spec['params'], sort_keys=True)} target={self.spec['target']}>"

    # ----- self-description
    def _inplace_slots(self) -> dict[int, int]:
        """{output position: input position} of outputs the kernel may write over an input (abi.inplace)."""
        pairs = self.abi.get("inplace", {})
        out_names, in_names = self.output_names, self.input_names
        return {out_names.index(o): in_names.index(i) for o, i in pairs.items() if o in out_names and i in in_names}

    def shape_of(self, slot: int) -> list:
        """A parameter's shape, with this kernel's fixed sizes filled in and runtime sizes by name."""
        fixed = self.abi.get("fixed", {})
        return [fixed.get(d, d) if isinstance(d, str) else d for d in self.abi["params"][slot]["shape"]]

    def _describe(self) -> tuple[str, inspect.Signature]:
        params = self.abi["params"]
        device = self.abi["device"]

        def ann(slot):
            return f"Tensor{_shape_text(self.shape_of(slot))} {params[slot]['dtype']}"

        try:
            import kernels

            kind_doc = kernels.get_kind(self.kind).doc
        except Exception:
            kind_doc = ""
        dynamic = [d["name"] for d in self.abi["dynamic"] if d["name"] not in self.abi.get("fixed", {})]
        outs = ", ".join(self.output_names)
        lines = [
            f"{self.kind} kernel for target {self.spec['target']}: {kind_doc}".rstrip(),
            "",
            "spec: " + ", ".join(f"{k}={v!r}" for k, v in sorted(self.spec["params"].items())),
            "",
            f"{self.kind}({', '.join(self.input_names)}, *, out=None) -> {outs}",
        ]
        lines += [f"    {params[s]['name']}: {ann(s)}" for s in self._inputs]
        lines += [f"    returns {params[s]['name']}: {ann(s)}" for s in self._outputs]
        lines += [
            "",
            f"Inputs: contiguous, on {device}, all on one device."
            + (f" Runtime sizes: {', '.join(dynamic)} (one value across all inputs)." if dynamic else " Every size is static."),
            "out=: a preallocated output (a tuple when there are several), contiguous, of the shape and dtype above;"
            " it is returned. The output is allocated otherwise (torch.empty: the caching allocator, current stream).",
        ]
        for o, i in self.inplace.items():
            lines.append(f"In place: out={self.input_names[i]} writes {self.output_names[o]} over {self.input_names[i]}.")
        if self.writes:
            lines.append(f"Updates in place: {', '.join(self.writes)} (inputs); called directly, never under torch.compile / torch.export.")
        lines += [
            "Inference only: raises RuntimeError if an input requires grad while grad mode is on.",
            f"Under torch.compile / torch.export: the op torch.ops.kernel_service.{self.kind} (.out with out=), the spec its first argument.",
        ]
        P = inspect.Parameter
        sig = inspect.Signature(
            [P(params[s]["name"], P.POSITIONAL_ONLY, annotation=ann(s)) for s in self._inputs]
            + [P("out", P.KEYWORD_ONLY, default=None, annotation=" | ".join([", ".join(ann(s) for s in self._outputs), "None"]))],
            return_annotation=", ".join(ann(s) for s in self._outputs),
        )
        return "\n".join(lines), sig

    # ----- checks
    def check_inputs(self, inputs) -> tuple[dict, object]:
        """The runtime sizes the inputs bind and their device; raises TypeError/ValueError naming the tensor."""
        import torch

        if len(inputs) != len(self._inputs):
            raise TypeError(f"{self.kind} takes {len(self._inputs)} tensors ({', '.join(self.input_names)}), got {len(inputs)}")
        params = self.abi["params"]
        fixed = self.abi.get("fixed", {})  # runtime dims of a shared build that this kernel's spec fixes
        dims: dict[str, int] = dict(fixed)
        device = None
        for slot, t in zip(self._inputs, inputs):
            p = params[slot]
            if not isinstance(t, torch.Tensor):
                raise _not_a_tensor(self.kind, f"input {p['name']}", t)
            if t.dtype != self._dtypes[slot]:
                raise TypeError(f"{self.kind}: input {p['name']} must be {p['dtype']}, got {str(t.dtype).removeprefix('torch.')}")
            if t.dim() != len(p["shape"]):
                raise ValueError(f"{self.kind}: input {p['name']} must have {len(p['shape'])} dims {p['shape']}, got shape {_sizes(t)}")
            for axis, (want, got) in enumerate(zip(p["shape"], t.shape)):
                if isinstance(want, str):
                    if want in fixed and got != fixed[want]:
                        raise ValueError(f"{self.kind}: this kernel was asked for with {want}={fixed[want]}, but {p['name']} has {want}={got} (axis {axis})")
                    if dims.setdefault(want, got) != got:
                        raise ValueError(f"{self.kind}: dim {want} is {dims[want]} elsewhere but {got} in {p['name']} (axis {axis})")
                elif want != got:
                    raise ValueError(f"{self.kind}: input {p['name']} must have shape {p['shape']}, got {_sizes(t)}")
            if not t.is_contiguous():
                raise ValueError(f"{self.kind}: input {p['name']} must be contiguous")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{self.kind}: all inputs must be on one device; {p['name']} is on {t.device}, others on {device}")
        if device is not None and device.type not in (self.abi["device"], "meta"):  # meta: shapes only, through the op's fake
            raise ValueError(f"{self.kind}: this kernel was built for {self.abi['device']}, inputs are on {device}")
        return dims, device

    def output_shapes(self, dims: dict) -> list[list]:
        params = self.abi["params"]
        return [[dims[d] if isinstance(d, str) else d for d in params[slot]["shape"]] for slot in self._outputs]

    def check_out(self, out, dims: dict, device) -> list:
        """`out=` as a list of tensors, checked against the output shapes; raises TypeError/ValueError."""
        import torch

        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(self._outputs):
            raise TypeError(f"{self.kind}: out= takes {len(self._outputs)} tensor(s) ({', '.join(self.output_names)}), got {len(outs)}")
        for pos, (t, shape) in enumerate(zip(outs, self.output_shapes(dims))):
            slot, name = self._outputs[pos], self.output_names[pos]
            if not isinstance(t, torch.Tensor):
                raise _not_a_tensor(self.kind, f"out {name}", t)
            if t.dtype != self._dtypes[slot]:
                raise TypeError(f"{self.kind}: out {name} must be {self.abi['params'][slot]['dtype']}, got {str(t.dtype).removeprefix('torch.')}")
            if list(t.shape) != list(shape):
                raise ValueError(f"{self.kind}: out {name} must have shape {tuple(shape)}, got {_sizes(t)}")
            if not t.is_contiguous():
                raise ValueError(f"{self.kind}: out {name} must be contiguous")
            if device is not None and t.device != device:
                raise ValueError(f"{self.kind}: out {name} is on {t.device}, the inputs on {device}")
        return outs

    def check_overlap(self, inputs, outs) -> None:
        """Outputs may not share memory with an input, except the one a kind writes over in place;
        an input the kernel updates (abi.writes) may not share memory with another input."""

        def span(t):
            start = t.data_ptr()
            return start, start + t.numel() * t.element_size()

        for name in self.writes:
            pos = self.input_names.index(name)
            lo, hi = span(inputs[pos])
            for other, t in enumerate(inputs):
                tlo, thi = span(t)
                if other != pos and t.numel() and inputs[pos].numel() and lo < thi and tlo < hi:
                    raise ValueError(f"{self.kind}: input {name}, which the kernel updates, overlaps input {self.input_names[other]}")

        for pos, o in enumerate(outs):
            if o.numel() == 0:
                continue
            lo, hi = span(o)
            for i, t in enumerate(inputs):
                tlo, thi = span(t)
                if t.numel() and lo < thi and tlo < hi:
                    if self.inplace.get(pos) == i and (tlo, thi) == (lo, hi):
                        continue
                    allowed = f"; only {self.input_names[self.inplace[pos]]} may be" if pos in self.inplace else ""
                    raise ValueError(f"{self.kind}: out {self.output_names[pos]} overlaps input {self.input_names[i]}{allowed}")
            for other in outs[:pos]:
                olo, ohi = span(other)
                if lo < ohi and olo < hi:
                    raise ValueError(f"{self.kind}: out tensors overlap")

    def check_grad(self, inputs) -> None:
        import torch

        if torch.is_grad_enabled():
            for name, t in zip(self.input_names, inputs):
                if getattr(t, "requires_grad", False):
                    raise RuntimeError(INFERENCE_ONLY.format(name=name, kind=self.kind))

    # ----- routing (a kind's dispatch: one callable over builds by range of a runtime dim)
    @property
    def dispatch(self) -> list[tuple[int | None, dict]] | None:
        """A router's ranges as [(inclusive upper bound or None, the build's spec), ...], None for
        a plain kernel: a call whose runtime `abi.dispatch.dim` is at most a bound runs that build."""
        d = self.abi.get("dispatch")
        return None if d is None else [(r["upto"], r["spec"]) for r in d["routes"]]

    @property
    def routes(self) -> list[tuple[int | None, Kernel]] | None:
        """A router's builds by range, once loaded (load_routes): [(upto, Kernel), ...]; None before, and for a plain kernel.
        Raises RuntimeError inside a CUDA graph capture while builds still load: a graph would
        keep the stand-in build for good (capture after ready())."""
        if self._loading is not None and _capturing():
            raise RuntimeError(f"{self.kind}: CUDA graph capture while this router's builds still load; call ready() first")
        return self._routes

    def load_routes(self, now: Callable[[dict], Kernel | None], later: Callable[[list[dict]], list] | None = None) -> None:
        """Loads a router's builds; nothing for a plain kernel or one whose builds are loaded.

        `now(spec)` gives a build at once, or None where it is not at hand (with no `later`, it
        must give each one, waiting as long as that takes: then no call compiles or loads, and
        every build is loaded here). With `later`, only the last range's build loads here (every
        range falls back to it, correct for every size: a router is ready after one build, cold
        or warm); the others load off this thread, `now` first, then `later(specs)` for those
        not at hand, as one list of Kernels or the exceptions met. Until each is there, calls in
        its range run the last range's build; ready() waits for them. Raises CorruptArtifact for
        a build that is not one."""
        if self.dispatch is None or self._routes is not None:
            return
        ranges = self.dispatch
        if later is None:
            self._routes = [(upto, _route_build(spec, now(spec))) for upto, spec in ranges]
            return
        last = ranges[-1][1]
        fallback = _route_build(last, now(last) or _loaded(later([last])[0]))
        self._routes = [(upto, fallback) for upto, _ in ranges]
        if len(ranges) > 1:
            self._loading = threading.Thread(target=self._load_others, args=(now, later), name=f"routes-{self.kind}", daemon=True)
            self._loading.start()

    def _load_others(self, now: Callable[[dict], Kernel | None], later: Callable[[list[dict]], list]) -> None:
        """The builds of every range but the last (load_routes), each swapped in as it loads."""
        ranges = self.dispatch

        def swap(i: int, got) -> None:
            try:
                build = _route_build(ranges[i][1], _loaded(got))
            except Exception as exc:  # noqa: BLE001 - kept for ready(); calls in its range keep the last range's build
                self._loading_error = exc
                log.warning("%s: a build of this router did not load (calls in its range run the last range's build): %s", self.kind, exc)
                return
            routes = list(self._routes)  # swapped whole: a call reads one list or the other
            routes[i] = (ranges[i][0], build)
            self._routes = routes

        try:
            missing = []
            for i in range(len(ranges) - 1):
                try:
                    got = now(ranges[i][1])
                except CorruptArtifact:  # asked of `later` then: the daemon replaces a damaged entry
                    got = None
                if got is None:
                    missing.append(i)
                else:
                    swap(i, got)
            if missing:
                for i, got in zip(missing, later([ranges[i][1] for i in missing])):
                    swap(i, got)
        except BaseException as exc:  # noqa: BLE001 - the whole request failed (daemon gone): kept for ready()
            self._loading_error = exc
            log.warning("%s: this router's other builds did not load (calls run the last range's build): %s", self.kind, exc)
        finally:
            self._loading = None  # loaded: calls and capture no longer ask

    def ready(self, timeout: float | None = None) -> Kernel:
        """This kernel, once every build it runs is loaded: for a router, the builds that load in
        the background (load_routes); a plain kernel is ready already. Raises what loading a
        build met, and TimeoutError past `timeout` seconds."""
        loading = self._loading  # the thread clears it when done
        if loading is not None:
            loading.join(timeout)
            if loading.is_alive():
                raise TimeoutError(f"{self.kind}: this router's builds did not load within {timeout} s")
        if self._loading_error is not None:
            raise self._loading_error
        return self

    def route(self, size: int) -> Kernel:
        """The kernel a call runs when the dispatch dim is `size` (itself for a plain kernel)."""
        if self._routes is None:
            if "dispatch" in self.abi:
                raise RuntimeError(f"{self.kind}: this router's builds are not loaded (Client.get_kernel loads them)")
            return self
        return next(k for upto, k in self.routes if upto is None or size <= upto)

    # ----- calls
    def __call__(self, *inputs, out=None):
        if out is None and self._fast is not None:
            result = self._fast(self, inputs)
            if result is not _CHECKED:
                return result
        import torch

        if torch.compiler.is_compiling() or not all(type(t) in fastcall.plain_types() for t in inputs):
            outs = () if out is None else out if isinstance(out, (tuple, list)) else (out,)
            named = [(f"input {n}", t) for n, t in zip(self.input_names, inputs)] + [(f"out {n}", t) for n, t in zip(self.output_names, outs)]
            for what, t in named:  # the op's schema error would print the whole value
                if not isinstance(t, torch.Tensor):
                    raise _not_a_tensor(self.kind, what, t)
            return self._call_op(inputs, out)  # traced: the torch op, whose fake derives shapes from the ABI
        self.check_grad(inputs)
        return self.run(inputs, out)

    def _own_outputs(self) -> RuntimeError:
        # A library that allocated its outputs itself (TileLang's callee-allocated ABI) left the
        # buffers it was given unwritten: never hand those back.
        return RuntimeError(
            f"{self.kind}: the library returned tensors of its own instead of writing its outputs; its entry was built for another call ABI (rebuild it)"
        )

    def _call_op(self, inputs, out):
        if self._op is None:
            raise RuntimeError(f"{self.kind}: this kernel has no torch op bound ({self.op_unbound}); it runs on plain tensors only")
        if out is None:
            result = self._op(self.spec_json, list(inputs))
            if not isinstance(result, (list, tuple)):
                return result
            return result[0] if len(self._outputs) == 1 else tuple(result)  # a list from a kind whose output count varies
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        self._op_out(self.spec_json, list(inputs), out=outs)
        return out

    def run(self, inputs, out=None):
        """Checks and runs on real tensors: the library call behind both paths (no grad check)."""
        import torch

        dims, device = self.check_inputs(inputs)
        if device is not None and device.type == "meta":
            return self._call_op(inputs, out)  # shapes only: the op's Meta kernel is its fake
        if self._check_metadata is not None:
            self._check_metadata(self, dict(zip(self.input_names, inputs)))
        if "dispatch" in self.abi:
            return self.route(dims[self.abi["dispatch"]["dim"]]).run(inputs, out)
        params = self.abi["params"]
        args = [None] * len(params)
        for slot, t in zip(self._inputs, inputs):
            args[slot] = t
        if out is None:
            if self.writes:
                self.check_overlap(inputs, [])
            for slot, t in zip(self._outputs, self.empty_outputs(dims, device)):
                args[slot] = t
        else:
            outs = self.check_out(out, dims, device)
            self.check_overlap(inputs, outs)
            for slot, t in zip(self._outputs, outs):
                args[slot] = t
        for slot in self._scratch:
            args[slot] = torch.empty([dims[d] if isinstance(d, str) else d for d in params[slot]["shape"]], dtype=self._dtypes[slot], device=device)
        if self.abi["loader"] == "c":
            extra = [_C_INTS[d["dtype"]](dims[d["name"]]) for d in self.abi["dynamic"]]
            with self._lock:  # the generated C keeps its error buffer in a static
                rc = self._fn(*[ctypes.c_void_p(t.data_ptr()) for t in args], *extra)
            if rc != 0:
                raise RuntimeError(f"{self.kind} kernel returned error {rc}")
        elif self._fn(*args) is not None:  # TVM-FFI launches on torch's current stream
            raise self._own_outputs()
        if out is not None:
            return out
        outs = [args[i] for i in self._outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def _not_a_tensor(kind: str, what: str, value) -> TypeError:
    """The one-line error for an argument that is not a torch.Tensor (never the value itself: an array prints whole)."""
    hint = " (torch.from_numpy(x) wraps one without a copy)" if type(value).__module__ == "numpy" else ""
    module = type(value).__module__
    named = type(value).__qualname__ if module == "builtins" else f"{module}.{type(value).__qualname__}"
    return TypeError(f"{kind}: {what} must be a torch.Tensor, got {named}{hint}")


def load(record: KernelRecord, *, root: Path, owner: int) -> Kernel:
    """Verifies and loads the entry an answer names (record.entry: see answered); raises
    CorruptArtifact on a failed check.

    `root`: the cache root (or a layer) the daemon reported; `owner`: the uid its files belong
    to (the daemon's; a layer's owner). The entry's entry.json must record the spec and ABI
    the answer names.
    """
    entry = record.entry
    with as_corrupt():
        check_location(root, entry.path, entry.key, owner)
        if not is_file_name(entry.library):
            raise EntryRefused(f"{entry.library!r} is not a file name of entry {entry.key[:16]}")
        try:
            abi_schema.check(entry.abi)
        except abi_schema.AbiError as exc:
            raise EntryRefused(f"{entry.path / entry.library}: {exc}") from None
        meta = read_meta(read_owned(entry.path / ENTRY_META, owner))
        if (meta["spec"], meta["abi"]) != (entry.meta["spec"], entry.abi):
            raise EntryRefused(f"{entry.path} records another kernel or ABI than the daemon's answer (spec {json.dumps(meta['spec'], sort_keys=True)[:200]})")
    return _open(record, owner)


def _open(record: KernelRecord, owner: int) -> Kernel:
    """Loads the library of an entry whose location and records are checked, once its bytes are
    `owner`'s and match the entry's sha256 and size; raises CorruptArtifact."""
    entry, abi = record.entry, record.entry.abi
    path = entry.path / entry.library
    with as_corrupt():
        data = read_verified(path, entry.library_sha256, entry.library_size, owner=owner)
    if abi["loader"] == "c":
        lib = dlopen_bytes(data, entry.key, ctypes.CDLL)
        fn = getattr(lib, abi["symbol"])
        fn.restype = ctypes.c_int32
        return Kernel(fn, record, keepalive=lib)
    if abi["loader"] == "tvm_ffi":
        module = dlopen_bytes(data, entry.key, _tvm_runtime().load_module)
        return Kernel(module[abi["symbol"]], record, keepalive=module)
    raise CorruptArtifact(f"unknown loader {abi['loader']!r} in {path}")


Published = Entry  # a published entry found on disk, its record checked: what a GetKernel reply would say

_found: Memo = Memo()  # entry directory -> (entry, its records' stat signature when checked)


def find_published(cache_root: Path, key: str, spec: dict, owner: int) -> Entry | None:
    """The entry published under `key` in the cache at `cache_root`, with its record checked as the
    daemon checks it (proto.entry): directories and files owned by `owner` (the daemon's uid), not
    writable by others, not symlinks; a manifest of this key and schema; an entry.json of the
    manifest's size and sha256, recording `spec` and a callable ABI. None when there is no such
    entry or a check fails (the caller then asks the daemon, which rebuilds what is damaged). The
    library is checked by load().

    As the daemon's index does, an entry checked before in this process is checked again only by
    its records' stat signature (a few lstat calls), and read again when that changed."""
    entry = entry_dir(cache_root, key)
    try:
        known = _found.get(entry)  # by directory: a key may be looked for in the cache root, then in layers
        if known is not None and known[0].meta["spec"] == spec:
            return known[0] if signature(entry, (ENTRY_META,)) == known[1] else _check_published(cache_root, entry, key, spec, owner)
        return _check_published(cache_root, entry, key, spec, owner)
    except OSError:  # gone
        return None


def _check_published(cache_root: Path, entry: Path, key: str, spec: dict, owner: int) -> Entry | None:
    try:
        sig = signature(entry, (ENTRY_META,))  # before reading: a change while we read shows next time
        check_location(cache_root, entry, key, owner)  # real directories of the daemon's uid, down from the root
        library, files = read_manifest(read_owned(entry / MANIFEST, owner), key)
        record = files[ENTRY_META]
        meta = read_meta(read_verified(entry / ENTRY_META, record["sha256"], record["size"], owner=owner), spec)
        found = Entry.of(key, entry, library, files, meta)
    except (OSError, ValueError, KeyError, TypeError):  # missing, refused (EntryRefused), garbage
        _found.pop(entry, None)
        return None
    _found.remember(entry, (found, sig))
    return found


def open_published(found: Entry, owner: int) -> Kernel | None:
    """The kernel of an entry find_published returned (its location and records checked, which
    load() checks): None when its library fails a check."""
    try:
        return _open(KernelRecord.published(found), owner)
    except CorruptArtifact:
        return None
