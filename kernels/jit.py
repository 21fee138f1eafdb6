"""A `@tilelang.jit` factory (or a plain function returning a `T.prim_func`) served as a kind.

    @tilelang.jit(out_idx=[-1])
    def gemm_geglu_kernel(F, K, bm=64, bn=64, stages=3, threads=128, dtype="float16"):
        M = T.dynamic("M")
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), ...): ...
        return main

is registered with one line (an entry point in group `kernel_service.kinds`, or
`serve --kernel-module pkg.mod:gemm_geglu_kernel`). The schema comes from the
signature: a parameter without a default is a required size (a positive int),
one with a default takes the default's type (int, float, bool, str), and one
named `dtype` is checked against the supported dtypes. Runtime sizes come from
`T.dynamic` in the PrimFunc, outputs from the decorator's `out_idx` (else the
last parameter). The same PrimFunc is built for every target, so a factory
meant for target "c" must use CPU-style TIR (serial loops, local buffers).
"""

from __future__ import annotations

import inspect

from .spec import DTYPES, MAX_DIM, REQUIRED, KernelKind, Param, Target


def _param(p: inspect.Parameter) -> Param:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
        raise TypeError(f"a served factory takes named parameters only, not *{p.name}")
    if p.name == "dtype":
        return Param("dtype", str, default=REQUIRED if p.default is p.empty else p.default, choices=DTYPES, doc="element type")
    if p.default is p.empty or p.default is None:
        return Param(p.name, int, default=REQUIRED if p.default is p.empty else None, min=1, max=MAX_DIM, nullable=p.default is None, doc="size")
    kind = type(p.default)
    if kind not in (int, float, bool, str):
        raise TypeError(f"parameter {p.name}: default {p.default!r} is not an int, float, bool or str")
    return Param(p.name, kind, default=p.default, doc=f"default {p.default!r}")


class JitKind(KernelKind):
    """A kind whose PrimFunc comes from calling a factory with the canonical params."""

    def __init__(self, name: str, factory):
        self.name = name
        self.factory = factory
        self._function = getattr(getattr(factory, "func", None), "orig_func", None) or factory  # the user's function
        self.doc = (inspect.getdoc(self._function) or "").split("\n\n")[0]
        signature = getattr(factory, "signature", None) or inspect.signature(self._function)
        self.params = tuple(_param(p) for p in signature.parameters.values())
        out_idx = getattr(factory, "out_idx", None)
        self.outputs = (-1,) if out_idx is None else tuple([out_idx] if isinstance(out_idx, int) else out_idx)

    def build(self, p: dict, target: Target):
        get_tir = getattr(self.factory, "get_tir", None)
        func = get_tir(**p) if get_tir else self.factory(**p)
        if getattr(func, "buffer_map", None) is None:
            raise TypeError(f"kind {self.name!r}: the factory returned {type(func).__name__}, not a T.prim_func")
        return func

    def source_files(self) -> list[str]:
        return [inspect.getsourcefile(self._function)]


def is_factory(obj) -> bool:
    """A `@tilelang.jit` object, or a plain function (not a class) to serve as a kind."""
    return hasattr(obj, "get_tir") or (inspect.isfunction(obj))
