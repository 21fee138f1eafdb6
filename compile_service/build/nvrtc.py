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
the process that made it, so workers cannot share one.

A compile uses, the first that fits:
- its family's own prelude's PCH, built by the worker's warm-up (compiler.warm_step
  and worker_init) once an earlier lowering of the kinds' warm-up examples has
  named the preludes;
- a shared prelude's (SHARED_PRELUDES: the headers TileLang includes for the
  zoo's elementwise kinds, and for all of them), which the worker's first compile
  that fits it makes, whatever its family, so that a later family's first compile
  in that worker parses no header. A compile through it reads headers it does not
  need, so it costs a little more than through its family's own, far less than a
  header parse (docs/measured.md). It serves only a source whose prelude holds
  nothing it lacks: a header or a macro of the source's own would change how the
  headers read.
Otherwise the compile parses the headers and leaves its own prelude's PCH behind.
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

from kernels.launch import GRID_X

from ..fsutil import pid_alive

log = logging.getLogger(__name__)

# What NVRTC reads before TileLang's source. It has no system headers: TileLang's shim stands in
# for <cstdint> and friends. The device runtime's header declares programmatic dependent launch
# (cudaGridDependencySynchronize), which nvcc includes implicitly. The same for every source, so
# the include block a PCH covers is the same for warm-up and real compiles.
_PREFIX = '#include <tl_templates/cuda/nvrtc_std.h>\n#include "cuda_device_runtime_api.h"\n'


# The headers TileLang 0.1.15 includes in the zoo's kernels (the union of the preludes of the
# kinds' warm-up examples), in two shared preludes: the elementwise and reduction kernels' few
# (norms, activations, rope, softmax: a PCH a third the size, so a worker whose first kernel is
# one of them pays no more than its own parse), and all of them, sm_90-only ones behind the arch
# (GEMM, attention). Each also holds the zoo's one directive of its own (kernels.launch.GRID_X)
# and the bf16 fallbacks as TileLang guards them. Every line of a source's prelude must be one
# of a shared prelude's lines for its PCH to serve the source (shared_prelude).
def _shared(headers: tuple[str, ...], sm90: tuple[str, ...] = ()) -> str:
    includes = "".join(f"#include <{h}>\n" for h in headers)
    if sm90:
        includes += "#if __CUDA_ARCH__ >= 900\n" + "".join(f"#include <{h}>\n" for h in sm90) + "#endif\n"
    return GRID_X + includes + "#ifdef ENABLE_BF16\n#include <tl_templates/cuda/cuda_bf16_fallbacks.cuh>\n#endif\n"


_ELEMENTWISE = ("math_constants.h", *(f"tl_templates/cuda/{h}.h" for h in ("reduce", "scan", "ldsm", "threadblock_swizzle", "debug")))
SHARED_PRELUDES = (
    _shared(_ELEMENTWISE),
    _shared(
        (*(f"tl_templates/cuda/{h}.h" for h in ("instruction/mma", "intrin", "barrier", "copy")), *_ELEMENTWISE),
        sm90=("tl_templates/cuda/instruction/wgmma.h", "tl_templates/cuda/copy_sm90.h"),
    ),
)
# Ends a shared prelude (a PCH covers the leading directives only), then numbers the source's
# lines as they are numbered without it, for -lineinfo.
_SHARED_END = f"namespace kernel_service_shared_prelude {{}}\n#line {_PREFIX.count(chr(10)) + 1}\n"

# NVRTC's PCH heap: all the shared headers need more than the 256 MB default.
_PCH_HEAP_BYTES = 1 << 30

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


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """The CUDA runtime headers TileLang's templates include (vector_types.h, cuda_fp16.h),
    plus CCCL's directory on CUDA 13; empty when none is found.

    $CUDA_HOME (or $CUDA_PATH), when set, is the only place looked at; otherwise the
    toolkit of the `nvcc` on PATH, then /usr/local/cuda and /usr/local/cuda-*.
    """
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
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


def shared_prelude(code: str) -> str | None:
    """The first of SHARED_PRELUDES whose PCH may serve `code`: every line of its prelude is one
    of the shared prelude's, once blank lines, comments and MSVC-only blocks are dropped."""
    lines = _active_lines(prelude(code))
    return next((p for p, shared in zip(SHARED_PRELUDES, _SHARED_LINES) if lines is not None and lines <= shared), None)


def _active_lines(head: str) -> set[str] | None:
    """The prelude's lines without blanks, comments and `#if defined(_MSC_VER) ...` blocks
    (TileLang's, false under NVRTC); None when such a block has an #else or #elif branch."""
    lines, depth = set(), 0
    for line in head.splitlines():
        s = line.strip()
        if depth:
            if s.startswith(("#else", "#elif")) and depth == 1:
                return None
            depth += s.startswith("#if") - s.startswith("#endif")
        elif re.fullmatch(r"#\s*if\s+defined\s*\(\s*_MSC_VER\s*\)(\s*&&.*)?|#\s*ifdef\s+_MSC_VER", s):
            depth = 1
        elif s and not s.startswith("//"):
            lines.add(s)
    return lines


_SHARED_LINES = [_active_lines(p) for p in SHARED_PRELUDES]


def tilelang_include_dirs() -> tuple[str, str]:
    """TileLang's template and CUTLASS include directories, found as tilelang.env finds them
    ($TL_TEMPLATE_PATH, $TL_CUTLASS_PATH, else beside the package) but without importing
    TileLang: a worker parses the headers while its TileLang import runs."""
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
        from cuda.bindings import nvrtc

        if nvrtc.nvrtcGetPCHHeapSize()[1] < _PCH_HEAP_BYTES:  # process-wide, set before any PCH is made
            nvrtc.nvrtcSetPCHHeapSize(_PCH_HEAP_BYTES)
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
        self._no_pch: set[str] = set()  # digests whose PCH NVRTC could not make
        self.compiles = 0  # programs compiled (the device-binary cache answers the rest)
        self.header_parses = 0  # of those, the ones no PCH served (each parses every header)
        self.shared_uses = 0  # of those, the ones the shared prelude's PCH served

    def has_pch(self, code: str, arch: str, extra: list[str] = ()) -> bool:
        return self._pch_key(_PREFIX + code, self._options(arch, extra)) in self._pch

    def _options(self, arch: str, extra) -> list[str]:
        return [*self.options, f"--gpu-architecture={arch}", *extra]

    @staticmethod
    def _pch_key(source: str, options: list[str]) -> str:
        return hashlib.sha256("\0".join([prelude(source), *options]).encode()).hexdigest()[:32]

    def compile(self, code: str, arch: str, extra: list[str] = (), own_pch: bool = False) -> bytes:
        """A cubin for `arch` ("sm_90a") from TileLang's CUDA source. `own_pch`: never through
        the shared prelude (a warm-up making the source's own PCH)."""
        options = self._options(arch, extra)
        own = _PREFIX + code
        shared = None if own_pch or self._pch_key(own, options) in self._pch else shared_prelude(code)
        shared_key = self._pch_key(_PREFIX + shared, options) if shared else None
        if shared is None or shared_key in self._no_pch:
            return self._compile(own, options, arch)
        try:
            cubin = self._compile(_PREFIX + shared + _SHARED_END + code, options, arch)
        except NvrtcError as exc:
            cubin = self._compile(own, options, arch)  # raises when the kernel itself is at fault
            self._no_pch.add(shared_key)  # the shared headers do not all compile here
            log.warning("a shared prelude does not compile for %s; its families parse their own headers: %s", arch, exc)
            return cubin
        self.shared_uses += 1
        return cubin

    def _compile(self, source: str, options: list[str], arch: str) -> bytes:
        """One NVRTC program: through its prelude's PCH, or making that PCH."""
        from cuda.bindings import nvrtc

        key = self._pch_key(source, options)
        options = list(options)
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
                    self._no_pch.add(key)  # for the shared prelude: no longer tried
                    log.warning("NVRTC made no PCH for a prelude (%s); its kernels parse every header", created.name)
            _, size = nvrtc.nvrtcGetCUBINSize(program)
            cubin = b" " * size
            nvrtc.nvrtcGetCUBIN(program, cubin)
        finally:
            nvrtc.nvrtcDestroyProgram(program)
        self.compiles += 1
        self.header_parses += not pch
        return cubin

    def warm(self, sources: list[str], arch: str) -> int:
        """Builds the PCH of each distinct prelude in `sources` now; returns how many.

        A prelude followed by one empty kernel is enough: NVRTC stops the header
        at the first line that is not a directive and saves what it parsed.
        """
        seen = set()
        for code in sources:
            head = prelude(code)
            if head in seen:
                continue
            seen.add(head)
            if self.has_pch(head, arch):
                continue
            start = time.perf_counter()
            try:
                self.compile(head + 'extern "C" __global__ void kernel_service_warm_up() {}\n', arch, own_pch=True)
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
    return options


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
