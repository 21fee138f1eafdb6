"""The CUDA device compiler, as a strategy: nvcc (TileLang's default, a subprocess) or
NVRTC (in process, with precompiled headers: build.nvrtc). Chosen once, in `choose`.

A device compiler has a name, a release (part of every CUDA key: binaries from
another compiler are other bytes), a reason it cannot run here (or None), the
function TileLang's device-compile callback calls, and an optional warm-up.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable

NVCC, NVRTC = "nvcc", "nvrtc"
ENV = "KERNEL_SERVICE_CUDA_COMPILER"
ID_ENV = "KERNEL_SERVICE_CUDA_COMPILER_ID"  # a serve-only host's stand-in for the builder's compiler


class DeviceCompiler:
    name: str

    @property
    def id(self) -> str:
        """The compiler and its release, as recorded in keys, entries and stats: "nvrtc-13.0"."""
        return f"{self.name}-{self.release()}"

    def release(self) -> str:
        raise NotImplementedError

    def unavailable_reason(self) -> str | None:
        return None

    def callback(self) -> Callable:
        """`compile(code, target, pass_config) -> bytes` for TileLang's device-compile callback.
        Called once per worker process; may import TileLang."""
        raise NotImplementedError

    def warm(self, sources: list[str], arch: str) -> int:
        """Prepares for compiling `sources`' kind of code (NVRTC: parses their header preludes).
        Needs no TileLang import, so it can run beside one."""
        return 0

    @property
    def compiles(self) -> int | None:
        """Device compiles run by this process so far, when the compiler counts them."""
        return None


class Nvcc(DeviceCompiler):
    name = NVCC

    @functools.cache
    def release(self) -> str:
        """nvcc's release (e.g. "13.0.88"), "none" without nvcc. CUDA_HOME or PATH only locate
        it: the key holds the release, never the path."""
        from .nvrtc import cuda_home

        home = cuda_home()
        nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
        if not nvcc or not os.path.exists(nvcc):
            return "none"
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        match = re.search(r"V(\d+\.\d+\.\d+)", out)
        return match.group(1) if match else "unknown"

    def callback(self) -> Callable:
        from tilelang.cuda import backend

        return backend.tilelang_callback_cuda_compile


class Nvrtc(DeviceCompiler):
    name = NVRTC

    def __init__(self):
        self._compiler = None
        self._lock = threading.Lock()  # worker_init's warm-up thread and its main thread both ask for it

    def release(self) -> str:
        from . import nvrtc

        return str(nvrtc.version())

    def unavailable_reason(self) -> str | None:
        from . import nvrtc

        return nvrtc.unavailable_reason()

    def _nvrtc(self):
        from . import nvrtc

        with self._lock:
            if self._compiler is None:
                self._compiler = nvrtc.Compiler(nvrtc.private_pch_dir())
            return self._compiler

    def callback(self) -> Callable:
        from . import nvrtc

        return nvrtc.callback(self._nvrtc())

    def warm(self, sources: list[str], arch: str, extra: list[str] = ()) -> int:
        return self._nvrtc().warm(sources, arch, extra)

    @property
    def compiles(self) -> int | None:
        return self._compiler.compiles if self._compiler else None


class Named(DeviceCompiler):
    """A device compiler known only by its id ("nvrtc-13.0"): keys are computed as if it built
    them, and nothing is compiled. For a serve-only host (`serve --no-compile
    --cuda-compiler-id ID`) fed by bundles from a builder that used that compiler."""

    def __init__(self, compiler_id: str):
        self.name, _, self._release = compiler_id.partition("-")

    def release(self) -> str:
        return self._release

    def unavailable_reason(self) -> str | None:
        return f"{self.id} is only named (--cuda-compiler-id): this process compiles nothing"

    def callback(self) -> Callable:
        raise RuntimeError(self.unavailable_reason())


_ID = re.compile(r"(nvrtc|nvcc)-\d+(\.\d+)*")


def named(compiler_id: str) -> DeviceCompiler:
    """The compiler whose id keys carry; raises ValueError for what is no compiler id."""
    if not _ID.fullmatch(compiler_id or ""):
        raise ValueError(f"--cuda-compiler-id must be a compiler and its release as keys record it, e.g. nvrtc-13.0 or nvcc-13.0.88; got {compiler_id!r}")
    return Named(compiler_id)


_COMPILERS: dict[str, type[DeviceCompiler]] = {NVCC: Nvcc, NVRTC: Nvrtc}


@functools.cache
def get(name: str) -> DeviceCompiler:
    """The process's one instance of the named compiler."""
    return _COMPILERS[name]()


def choose(requested: str | None = None, env=os.environ) -> DeviceCompiler:
    """The device compiler for "auto" | "nvrtc" | "nvcc" (None: $KERNEL_SERVICE_CUDA_COMPILER,
    else auto); auto takes NVRTC wherever it can run. Raises ValueError when NVRTC is asked
    for by name and cannot run here, saying why."""
    requested = requested or env.get(ENV) or "auto"
    if requested not in ("auto", NVRTC, NVCC):
        raise ValueError(f"--cuda-compiler must be auto, nvrtc or nvcc, got {requested!r}")
    if requested == NVCC:
        return get(NVCC)
    reason = get(NVRTC).unavailable_reason()
    if reason and requested == NVRTC:
        raise ValueError(f"--cuda-compiler nvrtc: {reason}")
    return get(NVCC) if reason else get(NVRTC)
