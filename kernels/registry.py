"""The table of kernel kinds, and the one entry point that validates a request."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from .spec import CanonicalSpec, InvalidSpec, KernelKind, parse_target

_KINDS: dict[str, KernelKind] = {}


def register(cls: type[KernelKind]) -> type[KernelKind]:
    """Class decorator: adds a kind to the registry under its `name`."""
    if cls.name in _KINDS:
        raise RuntimeError(f"kernel kind {cls.name!r} registered twice")
    _KINDS[cls.name] = cls()
    return cls


def get_kind(name: str) -> KernelKind:
    if not isinstance(name, str) or name not in _KINDS:
        raise InvalidSpec("kind", f"unknown kernel kind {name!r}; known kinds: {', '.join(sorted(_KINDS))}")
    return _KINDS[name]


def kinds() -> dict[str, KernelKind]:
    return dict(_KINDS)


def canonicalize(kind: str, params: dict, target: str | None = None) -> CanonicalSpec:
    """Validates a request and fills in defaults; raises InvalidSpec naming the bad field."""
    if not isinstance(params, dict):
        raise InvalidSpec("params", "expected a mapping of parameter names to values")
    return get_kind(kind).canonicalize(params, parse_target(target))


def source_digest() -> str:
    """sha256 over the source of this package and of every module that registered a kind
    (kinds loaded from outside, e.g. `kernel-service serve --kernel-module`): a code
    change invalidates every key."""
    files = set(Path(__file__).parent.rglob("*.py"))
    files.update(Path(inspect.getsourcefile(type(kind))) for kind in _KINDS.values())
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
