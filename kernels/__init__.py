"""The kernel zoo: kinds by name, each a validated signature -> TileLang PrimFunc.

A kind is self-contained in its module: parameter schema, CPU and CUDA builders,
torch reference and input maker. Kinds from outside come in through
kernels.plugins (entry points, `--kernel-module`) and kernels.jit (`@tilelang.jit`
factories). Importing this package is cheap: kinds import TileLang only when
they build.
"""

from . import add_rmsnorm, attention, gemm, kv_attention, layernorm, program, rmsnorm, rope, softmax, swiglu  # noqa: F401  (registers the kinds)
from .registry import canonicalize, get_kind, kinds, label, origin, register, source_digest
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
    "label",
    "origin",
    "parse_target",
    "register",
    "source_digest",
]
