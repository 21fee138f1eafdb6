"""In-process compile when no daemon answers, into the same cache the daemon uses.

A file lock per key makes concurrent processes compile each kernel once: the
first builds and publishes, the others wait on the lock and then find the entry.
Needs TileLang in this process; the daemon path never does.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from filelock import FileLock

import kernels
from compile_service import compiler
from compile_service.config import choose_cuda_compiler
from compile_service.keys import cache_key
from compile_service.paths import default_cache_dir
from compile_service.store import Store

from . import loader
from .errors import CompileError


@functools.cache
def _store(root: str) -> Store:
    # Keep the mode the daemon gave an existing cache (0750 when configured group-shared).
    try:
        mode = 0o750 if os.stat(root).st_mode & 0o777 == 0o750 else 0o700
    except FileNotFoundError:
        mode = 0o700
    return Store(root, mode)


@functools.cache
def _cuda_compiler() -> str:
    return choose_cuda_compiler()


@functools.cache
def _init_compiler(cache_root: str) -> None:
    compiler.worker_init((), cache_root, _cuda_compiler())


def build_locally(spec: kernels.CanonicalSpec, cache_dir: str | os.PathLike | None = None) -> loader.Kernel:
    store = _store(str(Path(cache_dir) if cache_dir else default_cache_dir()))
    key = cache_key(spec, _cuda_compiler())
    locks = store.root / "locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    outcome = "hit"
    with FileLock(str(locks / f"{key}.lock")):
        entry = store.lookup(key)
        if entry is None:
            _init_compiler(str(store.root))
            staging = store.new_staging(key)
            try:
                result = compiler.build(spec.to_json(), str(staging))
            except compiler.CompileFailed as exc:
                store.discard_staging(staging)
                raise CompileError(f"kernel {spec.kind} failed to compile:\n{exc}") from None
            entry = store.publish(key, staging, result["library"], result["meta"])
            outcome = "compiled"
    kernel = loader.load(entry.path, entry.library, entry.library_sha256, entry.library_size, entry.abi, entry.meta["spec"], key)
    kernel.outcome = outcome
    kernel.compile_seconds = entry.meta.get("compile_seconds", 0.0)
    return kernel
