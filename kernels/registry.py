"""The table of kernel kinds, the one entry point that validates a request, and each
kind's source digest (part of its keys)."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from .spec import CanonicalSpec, InvalidSpec, KernelKind, parse_target

_KINDS: dict[str, KernelKind] = {}
_ORIGINS: dict[str, str] = {}  # kind -> where it came from: "zoo", "entry point NAME (dist)", "module M"
_DIGESTS: dict[str, str] = {}  # kind -> source digest, computed once per process (keys are hot)


def register(cls: type[KernelKind] | KernelKind, origin: str | None = None):
    """Adds a kind (a KernelKind subclass, as a class decorator, or an instance) under its `name`."""
    kind = cls() if isinstance(cls, type) else cls
    if kind.name in _KINDS:
        if type(_KINDS[kind.name]) is type(kind) and kind.source_files() == _KINDS[kind.name].source_files():
            return cls  # the same kind reached twice (a module imported under two routes)
        raise RuntimeError(f"kernel kind {kind.name!r} registered twice ({_ORIGINS[kind.name]}, then {origin or type(kind).__module__})")
    _KINDS[kind.name] = kind
    _ORIGINS[kind.name] = origin or ("zoo" if type(kind).__module__.startswith("kernels.") else f"module {type(kind).__module__}")
    return cls


def get_kind(name: str) -> KernelKind:
    if not isinstance(name, str) or name not in _KINDS:
        raise InvalidSpec("kind", f"unknown kernel kind {name!r}; known kinds: {', '.join(sorted(_KINDS))}")
    return _KINDS[name]


def kinds() -> dict[str, KernelKind]:
    return dict(_KINDS)


def origin(name: str) -> str:
    return _ORIGINS.get(name, "unknown")


def label(spec: CanonicalSpec) -> str:
    """A spec as logs and messages name it: its JSON, but for kinds whose params are documents."""
    return get_kind(spec.kind).label(spec.params, spec.target) or spec.to_json()


def canonicalize(kind: str, params: dict, target: str | None = None) -> CanonicalSpec:
    """Validates a request and fills in defaults; raises InvalidSpec naming the bad field."""
    if not isinstance(params, dict):
        raise InvalidSpec("params", "expected a mapping of parameter names to values")
    return get_kind(kind).canonicalize(params, parse_target(target))


# ----- source digests: a kind's keys change when its source, or what it imports, changes


def _module_file(name: str) -> str | None:
    """The source file of an imported module (a kind's imports are imported by the time it
    registers); None for names that are not modules (`from .spec import dim`)."""
    path = getattr(sys.modules.get(name), "__file__", None)
    return path if path and path.endswith(".py") else None


def _local_imports(path: str, package: str) -> set[str]:
    """Modules `path` imports from its own top-level package or from `kernels` (the framework),
    read off its source: relative imports, `from kernels.x import`, `import kernels.x`. A
    top-level module (package "") has no package: its own are the top-level modules beside
    it in its directory (`from helpers import tile` next to `my_kinds.py`)."""
    tree = ast.parse(Path(path).read_text(), path)
    home = package.split(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if name in ("kernels", home) or not _module_file(name):
                continue
            if top in (home, "kernels") or (not home and "." not in name and _beside(_module_file(name), path)):
                found.add(name)
    return found


def _beside(module_file: str, path: str) -> bool:
    return Path(module_file).resolve().parent == Path(path).resolve().parent


@functools.cache
def _digest_of_files(files: tuple[str, ...], options: str = "{}") -> str:
    # Ordered by name and bytes, never by path: a kind and the framework installed under other
    # roots (a plugin in /opt, kernels in site-packages) digest the same on every host.
    # `options`: the kind's compile_options (pass configs, compile flags) as JSON.
    digest = hashlib.sha256(b"" if options == "{}" else options.encode() + b"\0")
    for name, data in sorted((Path(path).name.encode(), Path(path).read_bytes()) for path in files):
        digest.update(name + b"\0" + data + b"\0")
    return digest.hexdigest()


def dependency_files(kind: KernelKind) -> tuple[str, ...]:
    """The kind's own source files and, transitively, the modules they import from their own
    package or from `kernels` (package __init__ files, which only list kinds, excluded)."""
    seen: set[str] = set()
    todo = [(f, _package_of(f)) for f in kind.source_files()]
    while todo:
        path, package = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _local_imports(path, package):
            dep = _module_file(name)
            if dep and not dep.endswith("__init__.py"):
                todo.append((dep, name.rpartition(".")[0]))
    return tuple(sorted(seen))


def _package_of(path: str) -> str:
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == path:
            return name if path.endswith("__init__.py") else name.rpartition(".")[0]
    return ""


def source_digest(kind: str) -> str:
    """sha256 over the source that shapes `kind`'s kernels (and its compile_options): editing one
    kind changes only its keys.
    Read once per process: a running daemon keeps serving the code it started with."""
    digest = _DIGESTS.get(kind)
    if digest is None:
        k = get_kind(kind)
        options = json.dumps(k.compile_options, sort_keys=True, default=str)
        digest = _DIGESTS[kind] = _digest_of_files(dependency_files(k), options)
    return digest


def digest_sources() -> None:
    """Reads every registered kind's source digest now. A process that builds calls this right
    after importing its kinds, so that its builds record the source it imported, not what is on
    disk when a kind is first asked for."""
    for kind in list(_KINDS):
        source_digest(kind)
