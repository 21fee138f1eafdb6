"""Loads a published cache entry into a callable, without TileLang.

The shared object is opened once and checked through that one descriptor
(regular file, not a symlink, owned like its entry directory, not
group/world-writable, the size and sha256 the daemon published). The bytes
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
import ctypes
import functools
import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from proto import abi as abi_schema

from .errors import CorruptArtifact

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


def read_verified(path: Path, sha256: str, size: int) -> bytes:
    """The file's bytes, read through one descriptor after every check passed; raises CorruptArtifact."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CorruptArtifact(f"cannot open {path}: {exc.strerror} (symlinks are refused)") from None
    try:
        st = os.fstat(fd)
        owner = os.lstat(path.parent).st_uid
        if not stat.S_ISREG(st.st_mode):
            raise CorruptArtifact(f"{path} is not a regular file")
        if st.st_uid != owner:
            raise CorruptArtifact(f"{path} is owned by uid {st.st_uid}, not by the cache's owner (uid {owner})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CorruptArtifact(f"{path} is writable by group or others (mode {stat.filemode(st.st_mode)})")
        if st.st_size != size:
            raise CorruptArtifact(f"{path} has {st.st_size} bytes, expected {size}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise CorruptArtifact(f"{path} does not match its published sha256")
        return data
    finally:
        os.close(fd)


@functools.cache
def _private_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"kernel-service-load-{os.getpid()}-"))
    atexit.register(shutil.rmtree, path, True)  # each loaded copy is unlinked at once; this removes the directory
    return path


_names = itertools.count()


def _dlopen_bytes(data: bytes, key: str, opener):
    """opener(path) on a private copy of `data` under a name never used before in this process."""
    path = _private_dir() / f"{key[:16]}-{next(_names)}.so"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o500)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return opener(str(path))
    finally:
        path.unlink(missing_ok=True)  # the mapping outlives the name


@functools.cache
def _tvm_runtime() -> None:
    """Loads TileLang's native libraries, not its Python package (~30 ms, against seconds):
    libtvm_runtime.so registers TVM's CUDA module loader, libtilelang.so the host-side
    helpers CUDA kernels call at launch (e.g. TMA descriptor creation)."""
    import torch  # noqa: F401  (TileLang loads torch first too: shared CUDA libraries resolve against it)
    import tvm_ffi  # noqa: F401

    spec = importlib.util.find_spec("tilelang")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("TileLang's runtime library is needed to load CUDA kernels: pip install tilelang")
    libs = Path(next(iter(spec.submodule_search_locations))) / "lib"
    for name in ("libtvm_runtime.so", "libtilelang.so"):
        ctypes.CDLL(str(libs / name), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)


class Kernel:
    """A loaded kernel. Call it with the input tensors (in signature order); it
    allocates and returns the output (or a tuple of outputs)."""

    def __init__(self, fn, abi: dict, spec: dict, key: str, path: Path, keepalive=None):
        self._fn = fn
        self._keepalive = keepalive  # the ctypes library must outlive its functions
        self.abi = abi
        self.spec = spec
        self.key = key
        self.path = path
        self.kind = spec["kind"]
        params = abi["params"]
        self._outputs = abi["outputs"]
        self._inputs = [i for i in range(len(params)) if i not in self._outputs]
        self._dtypes = [_torch_dtype(p["dtype"]) for p in params]
        self._lock = threading.Lock() if abi["loader"] == "c" else None
        self.input_names = [params[i]["name"] for i in self._inputs]

    def __repr__(self) -> str:
        return f"<Kernel {self.kind} {json.dumps(self.spec['params'], sort_keys=True)} target={self.spec['target']}>"

    def _bind_dims(self, inputs) -> tuple[dict, object]:
        import torch

        params = self.abi["params"]
        fixed = self.abi.get("fixed", {})  # runtime dims of a shared build that this kernel's spec fixes
        dims: dict[str, int] = dict(fixed)
        device = None
        for slot, t in zip(self._inputs, inputs):
            p = params[slot]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.kind}: input {p['name']} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self._dtypes[slot]:
                raise TypeError(f"{self.kind}: input {p['name']} must be {p['dtype']}, got {str(t.dtype).removeprefix('torch.')}")
            if t.dim() != len(p["shape"]):
                raise ValueError(f"{self.kind}: input {p['name']} must have {len(p['shape'])} dims {p['shape']}, got shape {tuple(t.shape)}")
            for axis, (want, got) in enumerate(zip(p["shape"], t.shape)):
                if isinstance(want, str):
                    if want in fixed and got != fixed[want]:
                        raise ValueError(f"{self.kind}: this kernel was asked for with {want}={fixed[want]}, but {p['name']} has {want}={got} (axis {axis})")
                    if dims.setdefault(want, got) != got:
                        raise ValueError(f"{self.kind}: dim {want} is {dims[want]} elsewhere but {got} in {p['name']} (axis {axis})")
                elif want != got:
                    raise ValueError(f"{self.kind}: input {p['name']} must have shape {p['shape']}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{self.kind}: input {p['name']} must be contiguous")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{self.kind}: all inputs must be on one device; {p['name']} is on {t.device}, others on {device}")
        if device is not None and device.type != self.abi["device"]:
            raise ValueError(f"{self.kind}: this kernel was built for {self.abi['device']}, inputs are on {device}")
        return dims, device

    def __call__(self, *inputs):
        import torch

        if len(inputs) != len(self._inputs):
            raise TypeError(f"{self.kind} takes {len(self._inputs)} tensors ({', '.join(self.input_names)}), got {len(inputs)}")
        dims, device = self._bind_dims(inputs)
        params = self.abi["params"]
        args = [None] * len(params)
        for slot, t in zip(self._inputs, inputs):
            args[slot] = t
        for slot in self._outputs:
            shape = [dims[d] if isinstance(d, str) else d for d in params[slot]["shape"]]
            args[slot] = torch.empty(shape, dtype=self._dtypes[slot], device=device)
        if self.abi["loader"] == "c":
            extra = [_C_INTS[d["dtype"]](dims[d["name"]]) for d in self.abi["dynamic"]]
            with self._lock:  # the generated C keeps its error buffer in a static
                rc = self._fn(*[ctypes.c_void_p(t.data_ptr()) for t in args], *extra)
            if rc != 0:
                raise RuntimeError(f"{self.kind} kernel returned error {rc}")
        else:
            self._fn(*args)
        outs = [args[i] for i in self._outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def load(entry_dir: Path, library: str, sha256: str, size: int, abi: dict, spec: dict, key: str) -> Kernel:
    """Verifies and loads one entry's shared object; raises CorruptArtifact on a failed check."""
    path = Path(entry_dir) / library
    try:
        abi_schema.check(abi)
    except abi_schema.AbiError as exc:
        raise CorruptArtifact(f"{path}: {exc}") from None
    data = read_verified(path, sha256, size)
    if abi["loader"] == "c":
        lib = _dlopen_bytes(data, key, ctypes.CDLL)
        fn = getattr(lib, abi["symbol"])
        fn.restype = ctypes.c_int32
        return Kernel(fn, abi, spec, key, path, keepalive=lib)
    if abi["loader"] == "tvm_ffi":
        import tvm_ffi

        _tvm_runtime()
        module = _dlopen_bytes(data, key, tvm_ffi.load_module)
        return Kernel(module[abi["symbol"]], abi, spec, key, path, keepalive=module)
    raise CorruptArtifact(f"unknown loader {abi['loader']!r} in {path}")
