"""TileLang's own API, served: `install_tilelang_cache()` (or KERNEL_SERVICE_TILELANG=1 when the
process starts: client/tilelang_hook.py) routes every TileLang compile of this process through
the kernel service, with no change to the code that calls TileLang.

TileLang compiles everything through one place, its kernel cache's `cached()`: `@tilelang.jit`
in both styles, `tilelang.compile`, `par_compile`, `@autotune`'s candidates and its chosen
configuration. Installed, that place sends the PrimFunc as IR with the options TileLang resolved
(kernels.program); the daemon keys it by the IR's content, those options and its toolchain,
builds it once per host (and per fleet) as TileLang's own cache entry, and this process loads it
with `JITKernel.from_database`: TileLang's own adapter, out_idx, sources and profiler, so the
kernel behaves as the one `tilelang.compile` returns. `par_compile` of many PrimFuncs is one
batch on the daemon's pool.

- A kernel already in the cache is found there, without a round trip (as the zoo's kinds are).
- strict (KERNEL_SERVICE_STRICT=1): a kernel the cache does not hold raises KernelNotReady,
  naming it; nothing compiles in this process, with or without a daemon.
- app (KERNEL_SERVICE_APP): the daemon records every kernel asked for, so `kernel-service
  manifest --app`, prewarm, bundles and serve-only hosts cover TileLang code too.
- With no daemon answering, TileLang's own compile runs, with one warning per process.
- A kernel that may not travel (kernels.program says why: C source in a prelude, a backend
  other than tvm_ffi or cython, a flag that names a file) compiles here as TileLang would, with
  one warning per reason.
- TileLang's own cache turned off (TILELANG_DISABLE_CACHE): TileLang compiles here, as it would.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import kernels
from kernels import program
from proto.abi import PROGRAM
from proto.trust import read_verified

from . import api, loader
from .errors import CorruptArtifact, InvalidSpec, KernelNotReady, ServiceUnavailable

ENV = "KERNEL_SERVICE_TILELANG"  # "1": install at TileLang's import (client/tilelang_hook.py)
RETRY_DOWN = 30.0  # seconds a process compiles on its own after no daemon answered, before asking again


class TileLangCacheWarning(UserWarning):
    """TileLang compiled a kernel in this process instead of the kernel service (and why)."""


@dataclass
class _Installed:
    client: api.Client
    cached: object  # TileLang's KernelCache.cached
    par_compile: object  # TileLang's par_compile
    memo: dict = field(default_factory=dict)  # spec JSON -> JITKernel: the same object for the same program
    warned: set = field(default_factory=set)
    down_until: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def warn_once(self, reason: str, message: str) -> None:
        with self.lock:
            if reason in self.warned:
                return
            self.warned.add(reason)
        warnings.warn(message, TileLangCacheWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stack level of the first frame outside this package, TileLang and TVM: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("client", "tilelang", "tvm", "tvm_ffi"):
        frame, level = frame.f_back, level + 1
    return level


_installed: _Installed | None = None
_install_lock = threading.Lock()


def install_tilelang_cache(socket=None, *, strict: bool | None = None, app: str | None = None) -> api.Client:
    """Routes this process's TileLang compiles through the kernel service at `socket` (default
    $KERNEL_SERVICE_SOCKET, else the default path). `strict` (None: $KERNEL_SERVICE_STRICT=1):
    nothing compiles for this process, a kernel the cache lacks raises KernelNotReady. `app`
    (None: $KERNEL_SERVICE_APP): the daemon records every kernel asked for under that name.
    Imports TileLang. Installing again replaces the connection; returns it."""
    import tilelang  # noqa: F401  (this process runs TileLang: what is patched is its own)
    from tilelang.cache.kernel_cache import KernelCache

    global _installed
    with _install_lock:
        if _installed is not None:
            _restore(_installed)
        jit = sys.modules["tilelang.jit"]
        state = _Installed(api.Client(socket, strict=strict, app=app), KernelCache.__dict__["cached"], jit.par_compile)

        def cached(cache, func=None, out_idx=None, *args, **options):
            return _cached(state, cache, func, out_idx, *args, **options)

        def par_compile(funcs, out_idx=None, execution_backend=None, target=None, target_host=None, verbose=None, pass_configs=None, compile_flags=None, num_workers=None, ignore_error=False):  # fmt: skip
            options = {"execution_backend": execution_backend, "target": target, "target_host": target_host, "verbose": verbose, "pass_configs": pass_configs, "compile_flags": compile_flags}  # fmt: skip
            return _par_compile(state, list(funcs), out_idx, options, num_workers, ignore_error)

        cached.__doc__ = f"TileLang's KernelCache.cached, served by the kernel service (client.tilelang).\n\n{state.cached.__doc__ or ''}"
        par_compile.__doc__ = f"TileLang's par_compile, one batch on the kernel service's pool (client.tilelang).\n\n{state.par_compile.__doc__ or ''}"
        KernelCache.cached = cached
        jit.par_compile = tilelang.par_compile = par_compile
        _installed = state
        return state.client


def uninstall_tilelang_cache() -> None:
    """TileLang compiles in this process again, into its own cache. Kernels already loaded stay usable."""
    global _installed
    with _install_lock:
        if _installed is not None:
            _restore(_installed)
            _installed = None


def installed() -> api.Client | None:
    """The connection TileLang's compiles go through, or None."""
    return _installed.client if _installed is not None else None


def _restore(state: _Installed) -> None:
    import tilelang
    from tilelang.cache.kernel_cache import KernelCache

    KernelCache.cached = state.cached
    sys.modules["tilelang.jit"].par_compile = tilelang.par_compile = state.par_compile
    state.client.close()


# ----- one compile


def _resolve(target, target_host, execution_backend, pass_configs):
    """TileLang's backend context and normalized pass configs, resolved as its cache resolves them."""
    from tilelang import env
    from tilelang.backend.module import create_backend_context

    target = env.get_default_target() if target is None else target
    execution_backend = env.get_default_execution_backend() if execution_backend is None else execution_backend
    return create_backend_context(target, target_host, execution_backend), _normalized(pass_configs)


def program_spec(func, out_idx, context, pass_configs: dict, compile_flags, check: bool = True) -> kernels.CanonicalSpec:
    """The canonical spec (kind "tilelang") of one compile, as TileLang's cache receives it; raises
    program.NotTravelling naming what may not travel (`check`: kernels.program's rule; a spec
    only looked up in the cache needs none: an entry exists only for what the daemon checked)."""
    import tvm

    backend = context.execution_backend.name
    if backend not in program.BACKENDS:
        raise program.NotTravelling("program.execution_backend", f"TileLang's {backend} backend does not travel; only {', '.join(program.BACKENDS)}")
    try:
        ir = json.loads(tvm.ir.save_json(func))
        options = json.loads(json.dumps({"pass_configs": pass_configs or {}, "compile_flags": compile_flags}))
        target = json.loads(str(context.target))
        host = json.loads(str(context.target_host)) if context.target_host is not None else None
    except (TypeError, ValueError) as exc:  # an IR or option TVM or JSON cannot write
        raise program.NotTravelling("program", f"does not serialize: {exc}") from None
    for i, node in enumerate(ir.get("nodes", ())):  # spans name the file and line it was traced from
        if node.get("type") in ("ir.Span", "ir.SourceName"):
            ir["nodes"][i] = {"type": "None"}
    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else "main"
    flags = options["compile_flags"]
    doc = {
        "ir": ir,
        "name": str(name),
        "target": target,
        "target_host": host,
        "execution_backend": backend,
        "out_idx": _out_idx(out_idx, len(func.params)),
        "pass_configs": options["pass_configs"],
        "compile_flags": [flags] if isinstance(flags, str) else flags,
    }
    if check:
        program.check_program(doc)
    return kernels.CanonicalSpec(program.KIND, {program.FIELD: program.canonical_text(doc)}, kernels.parse_target(program.service_target(doc)))


def _out_idx(out_idx, params: int) -> list[int] | None:
    """out_idx as a list of parameter indices from 0: [-1] and [2] of a three-tensor kernel are one
    program (TileLang's own cache rewrites a caller's out_idx list in place when it loads a kernel)."""
    if out_idx is None:
        return None
    return [i % params if -params <= i < params else i for i in ([out_idx] if isinstance(out_idx, int) else out_idx)]


def _cached(state, cache, func, out_idx, *args, target=None, target_host=None, execution_backend=None, verbose=None, pass_configs=None, compile_flags=None, backend_context=None):  # fmt: skip
    """TileLang's KernelCache.cached, served."""
    from tilelang import env

    def own(context=backend_context, configs=pass_configs):  # TileLang's own compile, into its own cache
        return state.cached(
            cache, func, out_idx, *args, target=target, target_host=target_host, execution_backend=execution_backend,
            verbose=verbose, pass_configs=configs, compile_flags=compile_flags, backend_context=context,
        )  # fmt: skip

    if args or not env.is_cache_enabled():  # TileLang's own rules: its cache off, or arguments we cannot key
        return own()
    if backend_context is None:
        backend_context, pass_configs = _resolve(target, target_host, execution_backend, pass_configs)
    else:
        pass_configs = _normalized(pass_configs)
    try:
        spec = program_spec(func, out_idx, backend_context, pass_configs, compile_flags, check=False)  # checked before it is sent
    except program.NotTravelling as exc:
        return _here(state, exc, lambda: own(backend_context, pass_configs))
    return _serve(state, spec, func, backend_context, out_idx, pass_configs, compile_flags, lambda: own(backend_context, pass_configs))


def _normalized(pass_configs):
    from tilelang.transform.pass_config import normalize_pass_configs

    return normalize_pass_configs(pass_configs)


def _not_travelling(state, exc: program.NotTravelling, what: str = "a TileLang kernel") -> None:
    """A kernel that may not travel is compiled here, with one warning per reason; a strict
    process raises instead."""
    if state.client.strict:
        raise KernelNotReady(f"{what} cannot be sent to the kernel service ({exc}), and this process is strict: nothing compiles here")
    state.warn_once(f"travel:{exc.field}", f"kernel-service: {what} compiles in this process, not on the daemon: {exc}")


def _unavailable(state, exc: ServiceUnavailable, what: str) -> None:
    """No daemon answers: TileLang compiles here for RETRY_DOWN seconds, with one warning per
    process; a strict process raises instead."""
    if state.client.strict:
        raise KernelNotReady(f"{what}: no kernel service answers ({exc}), and this process is strict: nothing compiles here") from None
    state.down_until = time.monotonic() + RETRY_DOWN
    state.warn_once("unavailable", f"kernel-service: {exc}; TileLang compiles in this process meanwhile")


def _here(state, exc: program.NotTravelling, compile_here):
    _not_travelling(state, exc)
    kernel = compile_here()
    state.client.report_local_compiles(1)
    return kernel


def _serve(state, spec: kernels.CanonicalSpec, func, context, out_idx, pass_configs, compile_flags, compile_here):
    """The kernel of a program: this process's memo, the cache (no round trip), else the daemon."""
    memo_key = spec.to_json()
    kernel = state.memo.get(memo_key)
    if kernel is not None:
        return kernel
    if time.monotonic() < state.down_until and not state.client.strict:
        return compile_here()
    try:
        found = state.client.find(spec)
        if found is None:  # to be asked for: only what may travel
            program.check_program(program.parse(spec.params[program.FIELD]))
        entry, owner = found or state.client.entry(spec)[:2]
    except program.NotTravelling as exc:
        return _here(state, exc, compile_here)
    except InvalidSpec as exc:  # the daemon's rule refused what this process's let through (another release)
        return _here(state, program.NotTravelling(exc.field, f"the daemon refused it: {str(exc).split(': ', 1)[-1]}"), compile_here)
    except ServiceUnavailable as exc:
        _unavailable(state, exc, f"kernel {kernels.label(spec)}")
        return compile_here()
    kernel = load(entry, owner, func, context, out_idx, pass_configs, compile_flags)
    with state.lock:
        return state.memo.setdefault(memo_key, kernel)


def _compile_own(state, func, out_idx, context, pass_configs, compile_flags):
    """TileLang's own compile of a resolved request, into its own cache (TileLang's cache for the
    request's backend, as its dispatch picks it)."""
    from tilelang.cache import _resolve_cache_dispatch

    cache, _, _ = _resolve_cache_dispatch(context.target, context.target_host, context.execution_backend.name, False)
    return state.cached(cache, func, out_idx, backend_context=context, verbose=False, pass_configs=pass_configs, compile_flags=compile_flags)


def load(entry, owner: int, func, context, out_idx, pass_configs, compile_flags):
    """TileLang's JITKernel for a program's published entry (found and its records checked by the
    client), built as TileLang's cache builds one from disk: every file read once and checked
    against the entry's manifest (owner, size, sha256), the library loaded from a private copy of
    the checked bytes (client.loader). Raises CorruptArtifact."""
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource

    abi = entry.meta["abi"]
    if abi.get("loader") != PROGRAM or abi["backend"] != context.execution_backend.name:
        raise CorruptArtifact(f"{entry.path} holds no TileLang {context.execution_backend.name} kernel")
    with loader.as_corrupt():
        texts = {role: _read(entry, name, owner).decode() for role, name in abi["files"].items()}
        library = read_verified(entry.path / entry.library, entry.library_sha256, entry.library_size, owner=owner)
    try:
        params = load_kernel_params(texts["params"])
    except Exception as exc:  # noqa: BLE001 - TVM's loader raises its own types
        raise CorruptArtifact(f"{entry.path}: its parameter records do not load: {exc}") from None

    def open_library(path: str):
        return JITKernel.from_database(
            func=func,
            host_kernel_source=CachedTextSource(text=texts["host_source"]),
            device_kernel_source=CachedTextSource(text=texts["device_source"]),
            kernel_lib_path=path,
            params=params,
            target=context.target,
            target_host=context.target_host,
            out_idx=out_idx,
            execution_backend=context.execution_backend.name,
            pass_configs=pass_configs,
            compile_flags=compile_flags,
            backend_context=context,
        )

    return loader.dlopen_bytes(library, entry.key, open_library, keep=True)


def _read(entry, name: str, owner: int) -> bytes:
    record = (entry.files or {}).get(name)
    if record is None:
        raise CorruptArtifact(f"{entry.path}: its manifest does not list {name}")
    return read_verified(entry.path / name, record["sha256"], record["size"], owner=owner)


# ----- par_compile: one batch


def _merged(func, out_idx, pass_configs, compile_flags):
    """out_idx, pass_configs and compile_flags as `tilelang.compile` merges a PrimFunc's own
    (T.empty outputs, T.annotate_pass_configs, T.annotate_compile_flags) with the caller's."""
    attrs = func.attrs or {}
    if "tilelang_out_idx" in attrs:
        if out_idx is not None:
            raise ValueError("Out index conflict: out_idx is specified and prim_func have returned `T.empty` tensors")
        out_idx = list(attrs["tilelang_out_idx"])
    if "tilelang_pass_configs" in attrs:
        pass_configs = {**dict(attrs["tilelang_pass_configs"]), **(pass_configs or {})}
    if "tilelang_compile_flags" in attrs:
        extra = [] if compile_flags is None else [compile_flags] if isinstance(compile_flags, str) else list(compile_flags)
        compile_flags = list(attrs["tilelang_compile_flags"]) + extra
    return out_idx, pass_configs, compile_flags


def _par_compile(state, funcs: list, out_idx, options: dict, num_workers, ignore_error: bool):
    """TileLang's par_compile with the kernels that travel built as one batch on the daemon's pool
    (num_workers is the daemon's to decide), the others compiled here by TileLang's own."""
    from tilelang import env

    requests = {}
    if env.is_cache_enabled():
        for i, func in enumerate(funcs):
            try:
                index, configs, flags = _merged(func, out_idx, options["pass_configs"], options["compile_flags"])
                context, configs = _resolve(options["target"], options["target_host"], options["execution_backend"], configs)
                requests[i] = (program_spec(func, index, context, configs, flags), context, index, configs, flags)
            except program.NotTravelling as exc:
                _not_travelling(state, exc)
    own = [i for i in range(len(funcs)) if i not in requests]
    results: list = [None] * len(funcs)

    def served(i: int):
        spec, context, index, configs, flags = requests[i]
        return _serve(state, spec, funcs[i], context, index, configs, flags, lambda: _compile_own(state, funcs[i], index, context, configs, flags))

    errors = _batch(state, requests, served)  # each loaded as the daemon reports it built: loads overlap the builds still running
    untravelled = len(own)
    if errors is None:  # no daemon: TileLang's own, for all of them
        own, requests, untravelled = list(range(len(funcs))), {}, 0
    for i in requests:
        error = errors.get(i)
        if error is None:
            try:
                results[i] = served(i)
            except Exception as exc:  # noqa: BLE001 - reported as par_compile reports it
                error = exc
        if error is not None:
            if not ignore_error:
                raise error
            warnings.warn(f"Error compiling function at index {i}: {error}", TileLangCacheWarning, stacklevel=3)
    if own:
        compiled = state.par_compile([funcs[i] for i in own], out_idx, num_workers=num_workers, ignore_error=ignore_error, **options)
        for i, kernel in zip(own, compiled):
            results[i] = kernel
        if untravelled:  # they count in the daemon's stats
            state.client.report_local_compiles(untravelled)
    return results


def _batch(state, requests: dict, ready) -> dict | None:
    """Builds every request's program on the daemon in one Prefetch, with TileLang's progress bar,
    calling ready(index) as each is built; returns {index: exception} for those that failed, or
    None when no daemon answers (and this process is not strict)."""
    todo = [(i, r[0]) for i, r in requests.items() if r[0].to_json() not in state.memo]
    if not todo:
        return {}
    bar = _progress(len(todo))
    errors = {}

    def progress(done: int, total: int, event: dict) -> None:
        bar.update(1)
        i = todo[event["index"]][0]
        if not event.get("error_code"):
            try:
                ready(i)
            except Exception as exc:  # noqa: BLE001 - that kernel's answer, reported as par_compile reports it
                errors[i] = exc

    try:
        answers = state.client.prefetch([spec for _, spec in todo], load=False, progress=progress)
    except ServiceUnavailable as exc:
        _unavailable(state, exc, "par_compile")
        return None
    finally:
        bar.close()
    return {**errors, **{i: answer for (i, _), answer in zip(todo, answers) if isinstance(answer, Exception)}}


def _progress(total: int):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Parallel Compiling (kernel-service)")
    except ImportError:  # TileLang depends on tqdm; a progress bar is not worth failing for

        class _Quiet:
            def update(self, n):
                pass

            def close(self):
                pass

        return _Quiet()


def install_from_environment() -> None:
    """What KERNEL_SERVICE_TILELANG=1 does once TileLang is imported (client/tilelang_hook.py)."""
    if os.environ.get(ENV) == "1" and _installed is None:
        install_tilelang_cache()
