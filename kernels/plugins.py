"""Kinds from outside the zoo, loaded only from places the daemon's operator trusts.

- installed packages, through the entry-point group `kernel_service.kinds`: an
  entry point names a module (importing it registers its kinds), a KernelKind
  subclass, or a factory (kernels.jit), served under the entry point's name;
- `serve --kernel-module MODULE` or `--kernel-module MODULE:ATTR`, the same three.

Never a module a request names: requests only pick among registered kinds.
`allow` (serve --plugin NAME) narrows the entry points to the names given.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from importlib import metadata

from .jit import JitKind, is_factory
from .registry import register
from .spec import KernelKind

log = logging.getLogger(__name__)

GROUP = "kernel_service.kinds"


def _register(obj, name: str, origin: str) -> None:
    if inspect.ismodule(obj):
        return  # importing it registered its kinds
    if isinstance(obj, type) and issubclass(obj, KernelKind):
        register(obj, origin)
    elif isinstance(obj, KernelKind):
        register(obj, origin)
    elif is_factory(obj):
        register(JitKind(name, obj), origin)
    else:
        raise TypeError(f"{origin}: {obj!r} is not a module, a KernelKind or a kernel factory")


def load_module(target: str) -> None:
    """`MODULE` or `MODULE:ATTR` (a kind class, or a factory served under ATTR's name)."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        _register(getattr(module, attr), attr, f"module {target}")


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
