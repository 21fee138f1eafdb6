"""CUDA device code to a cubin inside the compile worker, through NVRTC.

TileLang turns a kernel into CUDA source and hands it to the callback
`tilelang_callback_cuda_compile`, which runs nvcc: a driver process that starts
cudafe++, cicc and ptxas, each parsing TileLang's and CUTLASS's headers again.
`callback()` makes a drop-in for it that calls NVRTC in process, keeping
everything else, so the host library, its ABI and the client's loader are the
same on both paths. (TileLang's own NVRTC backend also swaps the host side for
a Python launcher, and refuses to run where no GPU is visible; an explicit
`--gpu-architecture` is all NVRTC needs, so this path cross-compiles too.)

What makes it fast is NVRTC's precompiled headers (NVRTC 12.8 and later): the
first compile of a given #include prelude parses the headers and saves the
result; every later compile with the same prelude reuses it. TileLang emits a
handful of distinct preludes (one per family of kernels), so a process pays the
header parse once per family: an sm_90a GEMM's device code takes 1.4 s the
first time and 0.25 s after. A PCH is tied to the address of NVRTC's heap in
the process that made it, so workers cannot share one: each builds its own,
one prelude at a time while it has nothing else to do (compiler.warm_step).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import multiprocessing.util
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ..fsutil import pid_alive

log = logging.getLogger(__name__)

# What NVRTC reads before TileLang's source. It has no system headers: TileLang's shim stands in
# for <cstdint> and friends. The device runtime's header declares programmatic dependent launch
# (cudaGridDependencySynchronize), which nvcc includes implicitly. The same for every source, so
# the include block a PCH covers is the same for warm-up and real compiles.
_PREFIX = '#include <tl_templates/cuda/nvrtc_std.h>\n#include "cuda_device_runtime_api.h"\n'

# Diagnostics TileLang's headers trigger under NVRTC that say nothing about the kernel:
# 1444 deprecated longlong4, 20012 host/device annotations ignored on defaulted members.
_QUIET = ("-diag-suppress=1444,20012",)


class NvrtcError(RuntimeError):
    """NVRTC rejected the source; the message carries NVRTC's log."""


@functools.cache
def version() -> str | None:
    """NVRTC's release as "13.0", or None when NVRTC cannot be loaded here."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        result, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # the bindings are there but libnvrtc is not
        return None
    return f"{major}.{minor}" if result == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def cuda_home() -> str | None:
    """The CUDA toolkit the environment names ($CUDA_HOME, else $CUDA_PATH), None when neither is set:
    where both compilers look first."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """The CUDA runtime headers TileLang's templates include (vector_types.h, cuda_fp16.h),
    plus CCCL's directory on CUDA 13; empty when none is found.

    $CUDA_HOME (or $CUDA_PATH), when set, is the only place looked at; otherwise the
    toolkit of the `nvcc` on PATH, then /usr/local/cuda and /usr/local/cuda-*.
    """
    home = cuda_home()
    if home:
        roots = [home]
    else:
        nvcc = shutil.which("nvcc")
        roots = [str(Path(nvcc).resolve().parent.parent)] if nvcc else []
        roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for root in roots:
        for inc in (os.path.join(root, "include"), *glob.glob(os.path.join(root, "targets", "*-linux", "include"))):
            if os.path.exists(os.path.join(inc, "vector_types.h")):
                cccl = os.path.join(inc, "cccl")
                return (inc, cccl) if os.path.isdir(cccl) else (inc,)
    return ()


def unavailable_reason() -> str | None:
    """Why this machine cannot compile through NVRTC, or None when it can."""
    if version() is None:
        return "NVRTC is not installed (pip install cuda-bindings nvidia-cuda-nvrtc)"
    if tuple(int(x) for x in version().split(".")) < (12, 8):
        return f"NVRTC {version()} has no automatic precompiled headers (needs 12.8 or later)"
    if not cuda_include_dirs():
        return "no CUDA headers (vector_types.h) found; set CUDA_HOME"
    headers = headers_release()
    if headers and headers.split(".")[0] != version().split(".")[0]:
        return f"NVRTC {version()} does not match the CUDA {headers} headers in {cuda_include_dirs()[0]}; install the NVRTC of that release"
    return None


def headers_release() -> str | None:
    """The CUDA release of the headers NVRTC would compile against ("13.0"), from cuda.h."""
    try:
        text = Path(cuda_include_dirs()[0], "cuda.h").read_text(errors="replace")
    except (OSError, IndexError):
        return None
    match = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text)
    return f"{int(match.group(1)) // 1000}.{int(match.group(1)) % 1000 // 10}" if match else None


def prelude(code: str) -> str:
    """The leading preprocessor block of a source: what a precompiled header covers."""
    lines = []
    for line in code.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "//")):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


def tilelang_include_dirs() -> tuple[str, str]:
    """TileLang's template and CUTLASS include directories, found as tilelang.env finds them
    ($TL_TEMPLATE_PATH, $TL_CUTLASS_PATH, else beside the package) but without importing
    TileLang."""
    import importlib.util

    spec = importlib.util.find_spec("tilelang")
    root = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else ""
    third_party = os.path.join(root, "3rdparty")
    return (
        os.environ.get("TL_TEMPLATE_PATH") or os.path.join(third_party, "..", "src"),
        os.environ.get("TL_CUTLASS_PATH") or os.path.join(third_party, "cutlass", "include"),
    )


class Compiler:
    """One process's NVRTC: fixed options, and the PCHs it has built so far.

    PCHs are explicit (`--create-pch` / `--use-pch`), one file per prelude and options,
    so that whether a compile found one is known (`header_parses`), not guessed.
    """

    def __init__(self, pch_dir: str | None = None):
        reason = unavailable_reason()
        if reason:
            raise NvrtcError(reason)
        templates, cutlass = tilelang_include_dirs()
        self.options = [
            "-std=c++20",
            f"-I{templates}",
            f"-I{cutlass}",
            *(f"-I{d}" for d in cuda_include_dirs()),
            f"-D__CUDACC_VER_MAJOR__={version().split('.')[0]}",
            "-default-device",  # TileLang's headers leave device helpers unannotated; nvcc infers what NVRTC needs told
            "-lineinfo",  # as TileLang's nvcc path: profilers map SASS back to the source
            *_QUIET,
        ]
        self.pch_dir = pch_dir  # where this process writes the PCHs it makes; None: it makes none
        self._pch: dict[str, str] = {}  # prelude and options digest -> a PCH file made for them
        self.compiles = 0  # programs compiled (the device-binary cache answers the rest)
        self.header_parses = 0  # of those, the ones no PCH served (each parses every header)

    def has_pch(self, code: str, arch: str, extra: list[str] = ()) -> bool:
        return self._pch_key(_PREFIX + code, self._options(arch, extra)) in self._pch

    def _options(self, arch: str, extra) -> list[str]:
        return [*self.options, f"--gpu-architecture={arch}", *extra]

    @staticmethod
    def _pch_key(source: str, options: list[str]) -> str:
        return hashlib.sha256("\0".join([prelude(source), *options]).encode()).hexdigest()[:32]

    def compile(self, code: str, arch: str, extra: list[str] = ()) -> bytes:
        """A cubin for `arch` ("sm_90a") from TileLang's CUDA source."""
        from cuda.bindings import nvrtc

        source = _PREFIX + code
        options = self._options(arch, extra)
        key = self._pch_key(source, options)
        pch = self._pch.get(key)
        made = None
        if pch:
            options.append(f"--use-pch={pch}")
        elif self.pch_dir:
            made = os.path.join(self.pch_dir, f"{key}.pch")
            options.append(f"--create-pch={made}")
        result, program = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], [])
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(f"nvrtcCreateProgram: {result}")
        try:
            status = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])[0]
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(program, buf)
            text = buf.rstrip(b"\0").decode(errors="replace")
            if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                errors = [line for line in text.splitlines() if "error" in line]
                raise NvrtcError(f"NVRTC failed ({status.name}) for {arch}:\n" + "\n".join(errors[:20] or text.splitlines()[-20:]))
            if made:
                created = nvrtc.nvrtcGetPCHCreateStatus(program)[0]
                if created == nvrtc.nvrtcResult.NVRTC_SUCCESS:
                    self._pch[key] = made
                else:  # e.g. the PCH heap is full: this prelude is parsed each time
                    log.warning("NVRTC made no PCH for a prelude (%s); its kernels parse every header", created.name)
            _, size = nvrtc.nvrtcGetCUBINSize(program)
            cubin = b" " * size
            nvrtc.nvrtcGetCUBIN(program, cubin)
        finally:
            nvrtc.nvrtcDestroyProgram(program)
        self.compiles += 1
        self.header_parses += not pch
        return cubin

    def warm(self, sources: list[str], arch: str, extra: list[str] = ()) -> int:
        """Builds the PCH of each distinct prelude in `sources` for compiles with flags `extra`
        now; returns how many.

        A prelude followed by one empty kernel is enough: NVRTC stops the header
        at the first line that is not a directive and saves what it parsed.
        """
        seen = set()
        for code in sources:
            head = prelude(code)
            if head in seen:
                continue
            seen.add(head)
            if self.has_pch(head, arch, extra):
                continue
            start = time.perf_counter()
            try:
                self.compile(head + 'extern "C" __global__ void kernel_service_warm_up() {}\n', arch, extra)
            except NvrtcError as exc:  # a prelude that no longer compiles only costs its PCH
                log.warning("PCH warm-up failed for one prelude: %s", exc)
                continue
            log.debug("PCH for prelude %s built in %.2f s", hashlib.sha256(head.encode()).hexdigest()[:12], time.perf_counter() - start)
        return len(seen)


def private_pch_dir() -> str:
    """A directory for this process's PCH files (hundreds of MB), with any left by dead workers removed.

    Removed when the process exits; a worker killed with -9 leaves its directory
    behind for the next one to sweep. The shared parent must be a real directory of
    ours (another user could have made the name first, in /tmp); if not, a private
    temporary directory serves instead.
    """
    root = Path(tempfile.gettempdir()) / f"kernel-service-nvrtc-pch-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    except OSError:
        ours = False
    if ours:
        for stale in root.iterdir():
            if stale.name.isdigit() and not pid_alive(int(stale.name)):
                shutil.rmtree(stale, ignore_errors=True)
        mine = root / str(os.getpid())
        mine.mkdir(mode=0o700, exist_ok=True)
    else:
        mine = Path(tempfile.mkdtemp(prefix="kernel-service-nvrtc-pch-"))
    # At exit, in a pool worker too (multiprocessing ends its children with os._exit, skipping atexit).
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(mine),), kwargs={"ignore_errors": True}, exitpriority=0)
    return str(mine)


def device_options(pass_config) -> list[str]:
    """The per-kernel flags TileLang's nvcc callback derives from the pass config, in NVRTC's spelling."""
    import shlex

    from tilelang.transform import PassConfigKey

    cfg = pass_config or {}
    options = []
    if cfg.get(PassConfigKey.TL_ENABLE_FAST_MATH, False):
        options.append("--use_fast_math")
    level = cfg.get(PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL, None)
    if level is not None:
        options.append(f"--ptxas-options=--register-usage-level={int(level)}")
    extra = cfg.get(PassConfigKey.TL_DEVICE_COMPILE_FLAGS, None)
    if extra:
        for flag in [extra] if isinstance(extra, str) else extra:
            options += shlex.split(flag) if isinstance(flag, str) else [str(flag)]
    # nvcc's host-side optimisation levels and warning switches, which TileLang code passes as compile
    # flags (-O3, -Wno-deprecated-declarations): NVRTC takes neither and optimises device code anyway.
    return [o for o in options if not _NVCC_ONLY.fullmatch(o)]


_NVCC_ONLY = re.compile(r"-O[1-3]|-W[A-Za-z].*")


def callback(compiler: Compiler):
    """A drop-in for TileLang's `tilelang_callback_cuda_compile` that compiles with `compiler`.

    Binaries go through TileLang's device-binary cache (keyed by source, arch and
    options), so device code that several kernels share compiles once.
    """
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache
    from tilelang.contrib import nvcc
    from tilelang.cuda import backend

    def compile_cuda(code, target, pass_config=None):
        arch, codes = nvcc.get_target_arch_and_code(target)
        codes = nvcc.get_target_code_list(codes)
        if len(codes) > 1:  # a fatbin for several architectures: NVRTC makes one cubin at a time
            return backend.tilelang_callback_cuda_compile(code, target, pass_config)
        sm = codes[0] if codes else f"sm_{arch}"
        extra = device_options(pass_config)
        key = CUDABinaryCache.make_key(code=code, target_kind="cuda", target_arch=arch, target_code=[sm], compile_format="cubin", options=["nvrtc", *extra])
        binary = CUDABinaryCache.load(key, "cubin")
        if binary is None:
            binary = compiler.compile(code, sm, extra)
            CUDABinaryCache.save(key, "cubin", binary)
        return bytearray(binary)

    return compile_cuda
