"""The compiler adapter: the one place that calls TileLang.

Runs inside compile worker processes (see scheduler): lowering holds the GIL
between passes, so compiles in the daemon's own process would stall request
handling, and request handling would stall compiles.

One build writes into a staging directory:
    kernel.so      the host shared object (cubin embedded for CUDA)
    kernel.c|.cu   the generated device source, for humans
and returns the call ABI the client's loader needs, so loading a kernel never
needs TileLang, a PrimFunc, or a re-trace of the DSL.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .keys import nvcc_version, toolchain

LIBRARY = "kernel.so"


class CompileFailed(Exception):
    """TileLang could not build the kernel; the message carries its output."""


def load_kernel_modules(modules: tuple[str, ...]) -> None:
    """Imports extra modules that register kernel kinds (before any key is computed)."""
    import importlib

    for name in modules:
        importlib.import_module(name)


def device_binary_dir(cache_root: Path) -> Path:
    """Where TileLang's device-binary cache lives under our cache root, one per nvcc release:
    TileLang keys binaries by device source, arch and flags, but not by compiler version."""
    return Path(cache_root) / "device-binaries" / f"nvcc-{nvcc_version()}"


def worker_init(kernel_modules: tuple[str, ...] = (), device_binaries: str | None = None) -> None:
    """Per worker process: pay TileLang's import once, and point its device-binary cache at ours.

    Kernels that differ only in host-side values (a grid size, a static M that is a
    multiple of the tile) share their device code: TileLang's binary cache (keyed
    by the device source's hash, immutable, verified on load, published by rename)
    then saves the nvcc run. Its whole-kernel cache stays unused: build() calls
    JITKernel directly, and the daemon's store owns the entries.
    """
    import logging

    load_kernel_modules(kernel_modules)

    import tilelang  # noqa: F401
    from tilelang.env import env

    if device_binaries:
        env.TILELANG_CACHE_DIR = device_binaries  # a forced value: os.environ is left alone
    # TileLang logs every compile at INFO; the daemon reports compiles itself.
    logging.getLogger("tilelang").setLevel(logging.WARNING)


def _shape(dims) -> list:
    from tvm import tirx

    out = []
    for d in dims:
        if isinstance(d, tirx.IntImm):
            out.append(int(d))
        elif isinstance(d, tirx.Var):
            out.append(d.name)
        else:
            raise CompileFailed(f"unsupported symbolic shape expression {d}: only plain dims or named dynamic dims")
    return out


def call_abi(func, outputs: tuple[int, ...], target) -> dict:
    """How to call the built library, read off the PrimFunc."""
    from tvm import tirx

    params, dynamic = [], {}
    for param in func.params:
        if param not in func.buffer_map:
            raise CompileFailed(f"scalar parameter {param} is not supported by the loader")
        buf = func.buffer_map[param]
        # TileLang's C wrapper appends dynamic dims as int args in order of first
        # appearance over the parameters' shapes (TLCPUSourceWrapper.get_dynamic_symbolic_set).
        for d in buf.shape:
            if isinstance(d, tirx.Var):
                dynamic.setdefault(d.name, str(d.dtype))
        params.append({"name": buf.name, "dtype": str(buf.dtype), "shape": _shape(buf.shape)})
    n = len(params)
    symbol = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else "main"
    return {
        "loader": "c" if target.is_cpu else "tvm_ffi",
        "symbol": "call" if target.is_cpu else str(symbol),
        "device": "cpu" if target.is_cpu else "cuda",
        "params": params,
        "outputs": sorted(i % n for i in outputs),
        "dynamic": [{"name": name, "dtype": dtype} for name, dtype in dynamic.items()],
    }


def build(spec_json: str, staging: str) -> dict:
    """Compiles one canonical spec into `staging`; returns the library's file name
    and the entry's metadata (spec, abi, compile_seconds, toolchain).

    Raises CompileFailed with TileLang's message on any compile error, and
    OSError when the staging directory cannot be written.
    """
    import tilelang

    import kernels

    spec = json.loads(spec_json)
    target = kernels.parse_target(spec["target"])
    kind = kernels.get_kind(spec["kind"])
    out = Path(staging)
    start = time.perf_counter()
    try:
        func = kind.build(dict(spec["params"]), target)
        abi = call_abi(func, kind.outputs, target)
        # No out_idx: the caller allocates outputs, which keeps one plain ABI
        # for both loaders (TileLang's tvm_ffi path would otherwise switch to
        # callee-allocated outputs).
        kernel = tilelang.JITKernel(func, target=target.tilelang_target(), execution_backend="auto")
    except CompileFailed:
        raise
    except Exception as exc:  # TileLang raises many types; the caller needs the text, not the class
        raise CompileFailed(f"{type(exc).__name__}: {exc}") from None
    # Writing into the staging directory can fail (disk full): that is a cache error, raised
    # as OSError, not a compile failure to report as the kernel's fault or to remember.
    try:
        if target.is_cpu:
            shutil.copyfile(kernel.adapter.libpath, out / LIBRARY)
        else:
            kernel.adapter.get_exportable_executable().export_library(str(out / LIBRARY))
        source = kernel.get_kernel_source()
        if source:
            (out / ("kernel.c" if target.is_cpu else "kernel.cu")).write_text(source)
    except OSError:
        raise
    except Exception as exc:
        raise CompileFailed(f"exporting the built library failed: {type(exc).__name__}: {exc}") from None
    meta = {
        "spec": spec,
        "abi": abi,
        "compile_seconds": round(time.perf_counter() - start, 4),
        "toolchain": toolchain(target.kind),
        "created": time.time(),
    }
    return {"library": LIBRARY, "meta": meta}
