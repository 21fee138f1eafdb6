"""A `@tilelang.jit` factory (or a plain function returning a `T.prim_func`) served as a kind.

Both styles TileLang code is written in are served, registered with one line (an entry point
in group `kernel_service.kinds`, or `serve --kernel-module pkg.mod:attr`):

    @tilelang.jit(out_idx=[-1])                      # lazy: returns a PrimFunc
    def gemm_geglu_kernel(F, K, bm=64, stages=3, dtype="float16"):
        M = T.dynamic("M")
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), ...): ...
        return main

    @tilelang.jit                                    # eager: tensors as parameters, T.empty outputs
    def matmul(A, B, block_K=32, dtype=T.float16, accum_dtype=T.float32):
        M, N, K = T.const("M, N, K")
        A: T.Tensor((M, K), dtype)
        C = T.empty((M, N), dtype)
        ...
        return C

The schema, one rule per parameter of the function (tensor parameters of the eager style are
not parameters of the kind: they are the kernel's inputs):

- a `T.const` name of the body: a size, required; None makes it a runtime size (T.dynamic);
- a default of None: a size that may be None (the factory gets None: a runtime size it declares);
- a TileLang, torch or string dtype default (`accum_dtype=T.float32`), or no default and a name
  containing "dtype": a dtype-valued parameter, its value a dtype name;
- an annotation int, float, bool or str: that type (required without a default);
- a default int, float, bool or str: that type (ints unbounded: `num_stages=0` is fine);
- no default, no annotation, and named in a shape (an element of a tuple such as `(M, K)` in
  the body): a size, a positive int (so "64" and True are refused, naming it);
- otherwise (no default, no annotation): any int, float, bool or str, passed as given.

Outputs: the decorator's `out_idx`, or the PrimFunc's `T.empty` tensors (eager style), else
the last parameter; an eager function with no `T.empty` has none, as in TileLang (it returns
nothing, every tensor is an input, all taken as updated in place: `writes`). They are caller-allocated: the compiler builds `T.empty` outputs as
parameters the loader allocates (compiler._build_options). In-place and zero-output kernels
say so with `@kernels.jit.serve(...)` above the decorator (or a `kernel_service` attribute
holding the same dict): `outputs=()` and `writes=("X",)` for a kernel that only updates its
input X; `inplace={"Y": "X"}` for an output that may be written over input X.

The decorator's `pass_configs` and `compile_flags` go into the build and the keys
(KernelKind.compile_options); its `target`, when set, is the only target the kind builds for.
An `@autotune` object is served as the `@tilelang.jit` function it wraps: the daemon never
tunes, a request gives the tuned parameters as ordinary ones (run the tuner offline and pin
the configuration it picks). The same PrimFunc is built for every target, so a factory meant
for target "c" must use CPU-style TIR (serial loops, local buffers).
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import dataclass

from .spec import MAX_DIM, REQUIRED, TENSOR_DTYPES, InvalidSpec, KernelKind, Param, Target, plain, plain_any

OPTIONS = "kernel_service"  # the attribute serve() sets on a factory
_SERVE_KEYS = ("outputs", "inplace", "writes", "scratch")


def serve(*, outputs: tuple[int, ...] | None = None, inplace: dict[str, str] | None = None, writes: tuple[str, ...] = (), scratch: tuple[str, ...] = ()):
    """How kernel-service serves a factory, beside what the decorator says: `outputs` (indices
    into the PrimFunc's parameters; `()` for a kernel that returns nothing), `inplace`
    ({output: input} by buffer name, KernelKind.inplace), `writes` (inputs it updates in place,
    KernelKind.writes), `scratch` (per-call workspaces, KernelKind.scratch)."""

    def mark(factory):
        setattr(factory, OPTIONS, {"outputs": outputs, "inplace": dict(inplace or {}), "writes": tuple(writes), "scratch": tuple(scratch)})
        return factory

    return mark


@dataclass(frozen=True)
class ScalarParam(Param):
    """A parameter TileLang code leaves untyped (no default, no annotation): any int, float,
    bool or str, passed to the factory as given."""

    @property
    def type_name(self) -> str:
        return "int|float|bool|str"

    def check(self, value):
        value = plain_any(value)
        if value is None or not isinstance(value, (bool, int, float, str)):
            raise InvalidSpec(self.name, f"expected an int, float, bool or str, got {value!r}")
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidSpec(self.name, f"expected a finite number, got {value!r}")
            value += 0.0
        return value


def _annotation(p: inspect.Parameter):
    ann = p.annotation
    names = {"int": int, "float": float, "bool": bool, "str": str}
    return names.get(ann) if isinstance(ann, str) else (ann if ann in (int, float, bool, str) else None)


def _size(name: str, default=REQUIRED, doc: str = "size") -> Param:
    return Param(name, int, default=default, min=1, max=MAX_DIM, nullable=True, doc=doc)


def _param(p: inspect.Parameter, shape_names: frozenset = frozenset()) -> Param:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
        raise TypeError(f"a served factory takes named parameters only, not *{p.name}")
    default = REQUIRED if p.default is p.empty else p.default
    # A dtype: a default that is a dtype object (T.float32, torch.float16), any name; a dtype
    # name string, or no default and no annotation, for a name containing "dtype".
    dtype = None if default is REQUIRED or default is None else plain(default, str)
    named = "dtype" in p.name and (isinstance(default, str) or (default is REQUIRED and _annotation(p) in (None, str)))
    if (dtype in TENSOR_DTYPES and (not isinstance(default, str) or named)) or (default is REQUIRED and named):
        return Param(p.name, str, default=dtype if default is not REQUIRED else REQUIRED, choices=TENSOR_DTYPES, doc="dtype")
    if default is None:
        return _size(p.name, None, "size; None: a runtime size (the factory gets None)")
    kind = _annotation(p) or (type(default) if default is not REQUIRED else None)
    if kind is None:
        if default is not REQUIRED:
            raise TypeError(f"parameter {p.name}: default {default!r} is not an int, float, bool, str or dtype")
        if p.name in shape_names:
            return Param(p.name, int, min=1, max=MAX_DIM, doc="size (in a tensor shape): a positive int")
        return ScalarParam(p.name, object, doc="required (int, float, bool or str)")
    if kind not in (int, float, bool, str):
        raise TypeError(f"parameter {p.name}: default {default!r} is not an int, float, bool, str or dtype")
    return Param(p.name, kind, default=default, doc=f"required {kind.__name__}" if default is REQUIRED else f"{kind.__name__}, default {default!r}")


def _calls_empty(function) -> bool:
    """Whether the function's body calls `T.empty` (an eager-style output), read off its source;
    True when the source cannot be read (then the PrimFunc's record of them decides)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "empty" for n in ast.walk(tree))


def _shape_names(function) -> frozenset:
    """Names that are elements of a tuple or list the function's body builds, `(M, K)`: in
    TileLang code, shapes (read off its source; loop targets and subscripts left out)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    body = [node for fn in tree.body for node in getattr(fn, "body", [])]
    slices = {id(n.slice) for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Subscript)}
    return frozenset(
        e.id
        for stmt in body
        for n in ast.walk(stmt)
        if isinstance(n, (ast.Tuple, ast.List)) and isinstance(n.ctx, ast.Load) and id(n) not in slices
        for e in n.elts
        if isinstance(e, ast.Name)
    )


def _const_names(function) -> list[str]:
    """The names `T.const("M, N")` declares in the function's body, in order (read off its source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return []
    names = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "const"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names += [n for n in node.args[0].value.replace(",", " ").split() if n not in names]
    return names


def _target_fits(declared, target: Target) -> bool:
    """Whether a decorator's `target` ("c", "cuda", "cuda -arch=sm_90a", {"kind": ..., "arch": ...},
    a tvm Target; None or "auto": any) admits `target`."""
    if declared is None or declared == "auto":
        return True
    if isinstance(declared, dict):
        kind, arch = declared.get("kind"), declared.get("arch")
    else:
        text = str(declared)
        kind = text.split()[0] if text.split() else ""
        arch = next((w.split("=", 1)[1] for w in text.split() if w.startswith(("-arch=", "--arch="))), None)
    if kind == "c":
        return target.is_cpu
    if kind == "cuda":
        return not target.is_cpu and (arch is None or arch == target.arch)
    return False


class JitKind(KernelKind):
    """A kind whose PrimFunc comes from calling a factory with the canonical params."""

    def __init__(self, name: str, factory):
        self.name = name
        options = dict(getattr(factory, OPTIONS, None) or {})
        jit = getattr(factory, "jit_impl", None) or factory  # an @autotune object serves its @tilelang.jit
        options = {**dict(getattr(jit, OPTIONS, None) or {}), **options}
        self._function = jit_function(factory)
        unknown = sorted(set(options) - set(_SERVE_KEYS))
        if unknown:
            raise TypeError(f"kind {name!r}: unknown serve option {unknown[0]!r}; it takes {', '.join(_SERVE_KEYS)}")
        self.factory = jit
        self.doc = (inspect.getdoc(self._function) or "").split("\n\n")[0]
        signature = getattr(jit, "signature", None) or inspect.signature(self._function)
        tensors = set(getattr(getattr(jit, "func", None), "tensor_args", None) or ())  # eager style: the kernel's inputs
        shape_names = _shape_names(self._function)
        params = [_param(p, shape_names) for p in signature.parameters.values() if p.name not in tensors]
        self.consts = tuple(n for n in _const_names(self._function) if n not in signature.parameters)
        self.params = tuple(_size(n, doc="size (T.const); None: a runtime size") for n in self.consts) + tuple(params)
        out_idx = options.get("outputs")
        if out_idx is None:
            out_idx = getattr(jit, "out_idx", None)
        # An eager kernel with no T.empty returns nothing in TileLang: every tensor is an input it
        # may update (TileLang's splitK GEMM example accumulates into its C), so all are `writes`
        # unless serve(writes=) names them.
        written = ()
        if out_idx is None and tensors and not _calls_empty(self._function):
            out_idx = ()
            written = tuple(p for p in signature.parameters if p in tensors)
        self.outputs = (-1,) if out_idx is None else tuple([out_idx] if isinstance(out_idx, int) else out_idx)
        self._inplace, self._writes, self._scratch = options.get("inplace") or {}, tuple(options.get("writes") or written), tuple(options.get("scratch") or ())
        self._target = getattr(jit, "target", None)
        self.compile_options = {k: v for k in ("pass_configs", "compile_flags") if (v := getattr(jit, k, None))}

    def check(self, p: dict, target: Target):
        if not _target_fits(self._target, target):
            raise InvalidSpec("target", f"kind {self.name!r} is declared for target {self._target!r} (its decorator's target), not {target.describe()}")
        return None

    def build(self, p: dict, target: Target):
        import tilelang.language as T

        args = {k: (T.dynamic(k) if v is None and k in self.consts else v) for k, v in p.items()}
        get_tir = getattr(self.factory, "get_tir", None)
        func = get_tir(**args) if get_tir else self.factory(**args)
        if getattr(func, "buffer_map", None) is None:
            raise TypeError(f"kind {self.name!r}: the factory returned {type(func).__name__}, not a T.prim_func")
        return func

    def inplace(self, p: dict) -> dict[str, str]:
        return dict(self._inplace)

    def writes(self, p: dict) -> tuple[str, ...]:
        return self._writes

    def scratch(self, p: dict) -> tuple[str, ...]:
        return self._scratch

    def source_files(self) -> list[str]:
        # The class's file (kernels/jit.py, or a subclass's) shapes the build as the factory does.
        return [inspect.getsourcefile(type(self)), inspect.getsourcefile(self._function)]


def is_jit_object(obj) -> bool:
    """A `@tilelang.jit` or `@autotune` object (what a module is served for, beside its kinds)."""
    return not isinstance(obj, type) and (hasattr(obj, "get_tir") or hasattr(getattr(obj, "jit_impl", None), "get_tir"))


def jit_function(obj):
    """The user's function behind a factory."""
    jit = getattr(obj, "jit_impl", None) or obj
    return getattr(getattr(jit, "func", None), "orig_func", None) or jit


def is_factory(obj) -> bool:
    """A `@tilelang.jit` or `@autotune` object, or a plain function (not a class) to serve as a kind."""
    return hasattr(obj, "get_tir") or hasattr(obj, "jit_impl") or inspect.isfunction(obj)
