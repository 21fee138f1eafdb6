"""Kinds from outside the zoo, loaded only from places the daemon's operator trusts.

- installed packages, through the entry-point group `kernel_service.kinds`: an
  entry point names a module (importing it registers its kinds, and each
  `@tilelang.jit` / `@autotune` object it defines is served under its name), a
  KernelKind subclass, or a factory (kernels.jit), served under the entry point's name;
- `serve --kernel-module MODULE` or `--kernel-module MODULE:ATTR`, the same three, imported only
  when no other user than this process's or root could have written it.

Never a module a request names: requests only pick among registered kinds.
`allow` (serve --plugin NAME) narrows the entry points to the names given.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from importlib import metadata

from proto.trust import not_yours_on_the_way

from .jit import JitKind, is_factory, is_jit_object, jit_function
from .registry import register
from .spec import KernelKind

log = logging.getLogger(__name__)

GROUP = "kernel_service.kinds"


def _register(obj, name: str, origin: str) -> None:
    if inspect.ismodule(obj):
        # Importing it registered its kinds; its own @tilelang.jit / @autotune objects (not
        # ones it imports) are served under their names.
        for attr, value in vars(obj).items():
            if is_jit_object(value) and getattr(jit_function(value), "__module__", None) == obj.__name__:
                register(JitKind(attr, value), origin)
        return
    if isinstance(obj, type) and issubclass(obj, KernelKind):
        register(obj, origin)
    elif isinstance(obj, KernelKind):
        register(obj, origin)
    elif is_factory(obj):
        register(JitKind(name, obj), origin)
    else:
        raise TypeError(f"{origin}: {obj!r} is not a module, a KernelKind or a kernel factory")


class KernelModuleError(ValueError):
    """A --kernel-module that cannot be loaded: the message names it, what failed and the fix."""


def load_module(target: str) -> None:
    """`MODULE` (its kinds and @tilelang.jit objects) or `MODULE:ATTR` (a kind class, or a
    factory served under ATTR's name). Raises KernelModuleError."""
    module_name, _, attr = target.partition(":")
    _refuse_others_code(target, module_name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:  # the module, or one it imports
        raise KernelModuleError(
            f"--kernel-module {target}: no module named {exc.name!r} here; the daemon imports it from its own "
            "Python path: set PYTHONPATH to the directory that holds it, or install it"
        ) from None
    except Exception as exc:  # noqa: BLE001 - its own code failed, whatever way: one line, not a traceback
        raise KernelModuleError(f"--kernel-module {target}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    if attr and not hasattr(module, attr):
        raise KernelModuleError(f"--kernel-module {target}: module {module_name} has no attribute {attr!r}; ATTR names a kind class or a kernel factory in it")
    _register(getattr(module, attr) if attr else module, attr, f"module {target}")


def _refuse_others_code(target: str, module_name: str) -> None:
    """Refuses a module that a user other than this process's or root could have written, before
    any of it runs (as bundles are refused): whoever may write its file, or a directory on the
    way to it, chooses the code a daemon runs, as root perhaps."""
    me = os.geteuid()
    for path in _import_files(module_name):
        why = not_yours_on_the_way(path, me)
        if why:
            raise KernelModuleError(
                f"--kernel-module {target}: {why}: whoever may write it chooses the code this process runs; "
                "refusing to import it (keep it where only you or root may write)"
            )


def _import_files(module_name: str) -> list[str]:
    """What importing `module_name` runs: each package's __init__ on the way and the module's own
    file (for a namespace package, the directories searched), found as the import system finds
    them without running anything. Modules already imported run nothing again and are skipped;
    the list stops at a name that is not found (the import then says so)."""
    files: list[str] = []
    search = None  # sys.path, then each package's own path
    parts = module_name.split(".")
    for name in (".".join(parts[: i + 1]) for i in range(len(parts))):
        loaded = sys.modules.get(name)
        if loaded is not None:
            search = getattr(loaded, "__path__", None)
            continue
        spec = _find_spec(name, search)
        if spec is None:
            break
        files.extend([spec.origin] if spec.has_location else spec.submodule_search_locations or ())
        search = spec.submodule_search_locations
    return files


def _find_spec(name: str, search):
    """importlib.util.find_spec without importing the parent packages: asks each finder directly."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, search) if find else None
        if spec is not None:
            return spec
    return None


def load_entry_points(allow: tuple[str, ...] | None = None) -> list[str]:
    """Loads the installed kinds (all, or those named in `allow`); returns their names."""
    loaded = []
    for ep in metadata.entry_points(group=GROUP):
        if allow is not None and ep.name not in allow:
            continue
        dist = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
        _register(ep.load(), ep.name, f"entry point {ep.name}{dist}")
        loaded.append(ep.name)
    missing = sorted(set(allow or ()) - set(loaded))
    if missing:
        raise LookupError(f"no installed kernel kind plugin named {', '.join(missing)} (entry-point group {GROUP})")
    return loaded


def load(modules: tuple[str, ...] = (), entry_points: bool = True, allow: tuple[str, ...] | None = None) -> None:
    """Everything a daemon (and each of its workers) serves beyond the zoo."""
    for target in modules:
        load_module(target)
    if entry_points:
        load_entry_points(allow)
