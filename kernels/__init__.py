"""The kernel zoo: kinds by name, each a validated signature -> TileLang PrimFunc.

Importing this package is cheap: kinds import TileLang only when they build.
"""

from . import attention, gemm, rmsnorm, softmax, swiglu  # noqa: F401  (registers the kinds)
from .registry import canonicalize, get_kind, kinds, source_digest
from .spec import CanonicalSpec, InvalidSpec, KernelKind, Param, Target, parse_target

__all__ = [
    "CanonicalSpec",
    "InvalidSpec",
    "KernelKind",
    "Param",
    "Target",
    "canonicalize",
    "get_kind",
    "kinds",
    "parse_target",
    "source_digest",
]
