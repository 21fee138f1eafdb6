"""Kernel signatures: targets, parameter schemas and validation.

Nothing here imports TileLang: the daemon validates every request with this
module before any compile work, and the client can use it without paying the
compiler's import.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from proto.errors import InvalidSpec  # defined in the contract; importable from here as before

__all__ = ["InvalidSpec", "Target", "parse_target", "Param", "KernelKind", "CanonicalSpec", "REQUIRED"]

# Sizes above this are rejected as absurd: no tensor dimension of a real model
# comes near it, and it keeps every index inside int32 arithmetic.
MAX_DIM = 1 << 20
DTYPES_16 = ("float16", "bfloat16")
DTYPES = ("float16", "bfloat16", "float32")
# Every dtype a tensor of a served kernel may have (what the client's loader allocates): the
# choices of a factory's dtype-valued parameters (kernels.jit).
TENSOR_DTYPES = DTYPES + ("float64", "int8", "uint8", "int32", "int64", "bool")


# Exact and ASCII-only: matched with fullmatch (a "$" would let a trailing newline through)
# and [0-9] (\d also matches other scripts' digits, "sm_٩٠a").
_ARCH = re.compile(r"sm_([0-9]{2,3})(a?)")
# The CUDA archs TileLang 0.1.15 builds for: its target families are Volta (sm_70/72),
# Turing (sm_75), Ampere and Ada (sm_80-89), Hopper (sm_90), the sm_100 family (sm_100-110)
# and sm_120 (sm_120/121); "a" marks the arch-specific feature sets of sm_90 and newer.
# Anything else would reach a worker only to fail inside TileLang.
CUDA_ARCHS = frozenset(
    ["sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89"] + [f"sm_{cc}{suffix}" for cc in (90, 100, 101, 103, 110, 120, 121) for suffix in ("", "a")]
)


@dataclass(frozen=True)
class Target:
    """Where a kernel runs: `c` (the CPU, via generated C) or `cuda` with an arch."""

    kind: str  # "c" or "cuda"
    arch: str | None = None  # "sm_90a" for cuda
    auto: bool = field(default=False, compare=False)  # chosen by "auto" (this host's GPU, else the CPU)

    def __str__(self) -> str:
        return self.arch if self.kind == "cuda" else "c"

    def describe(self) -> str:
        """The target as error messages name it, saying when "auto" chose the CPU."""
        if self.auto and self.is_cpu:
            return "'c' (what target 'auto' chose: no GPU is visible on this host; name a CUDA target such as 'sm_90a' to build for one)"
        return f"'{self}'"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "c"

    @property
    def compute_capability(self) -> int | None:
        """90 for sm_90a, 80 for sm_80; None on the CPU."""
        return int(_ARCH.fullmatch(self.arch).group(1)) if self.arch else None

    def tilelang_target(self) -> str | dict:
        # TileLang rejects the string form "cuda -arch=..."; the dict form works.
        return "c" if self.is_cpu else {"kind": "cuda", "arch": self.arch}


@functools.cache
def detect_local_target() -> Target:
    """The local GPU's arch, else the CPU. Hopper gets `sm_90a` (its wgmma/setmaxnreg need it).

    Asks nvidia-smi rather than torch, so that resolving "auto" never creates a
    CUDA context in the daemon.
    """
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split()
        major, minor = out[0].split(".")
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return Target("c")
    suffix = "a" if (major, minor) == ("9", "0") else ""
    return Target("cuda", f"sm_{major}{minor}{suffix}")


def parse_target(text: str | None) -> Target:
    """Accepts "c", "auto" (or None) and CUDA arch names such as "sm_90a" or "sm_80"."""
    if text is None or text == "auto":
        return replace(detect_local_target(), auto=True)
    if not isinstance(text, str):
        raise InvalidSpec("target", f"expected a string such as 'c', 'auto' or 'sm_90a', got {type(text).__name__}")
    if text == "c":
        return Target("c")
    if text in CUDA_ARCHS:
        return Target("cuda", text)
    raise InvalidSpec(
        "target", f"unknown target {text[:40]!r}; use 'c', 'auto' or a CUDA arch TileLang builds for: {', '.join(sorted(CUDA_ARCHS, key=_arch_order))}"
    )


def _arch_order(arch: str) -> tuple:
    match = _ARCH.fullmatch(arch)
    return int(match.group(1)), match.group(2)


REQUIRED: Any = object()


@dataclass(frozen=True)
class Param:
    """One public parameter of a kernel kind: its type, default and bounds."""

    name: str
    type: type  # int, float, bool or str
    default: Any = REQUIRED
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    nullable: bool = False  # None allowed: a runtime (dynamic) dimension, or "use the default tiling"
    doc: str = ""

    @property
    def type_name(self) -> str:
        return self.type.__name__

    @property
    def is_dtype(self) -> bool:
        """A dtype-valued parameter, whatever its name: a str choosing among tensor dtypes."""
        return self.type is str and bool(self.choices) and set(self.choices) <= set(TENSOR_DTYPES)

    def check(self, value: Any) -> Any:
        if value is None:
            if self.nullable:
                return None
            raise InvalidSpec(self.name, "must not be None")
        value = plain(value, self.type)
        # bool is an int subclass; a size given as True is a bug, not a 1.
        if self.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidSpec(self.name, f"expected an integer, got {value!r}")
        if self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidSpec(self.name, f"expected a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise InvalidSpec(self.name, f"expected a finite number, got {value!r}")
            value += 0.0  # -0.0 becomes 0.0: one canonical zero, so one key
        if self.type is bool and not isinstance(value, bool):
            raise InvalidSpec(self.name, f"expected true or false, got {value!r}")
        if self.type is str and not isinstance(value, str):
            raise InvalidSpec(self.name, f"expected a string, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise InvalidSpec(self.name, f"{value!r} is not one of {', '.join(map(str, self.choices))}")
        if self.min is not None and value < self.min:
            raise InvalidSpec(self.name, f"must be at least {self.min}, got {value!r}")
        if self.max is not None and value > self.max:
            raise InvalidSpec(self.name, f"must be at most {self.max}, got {value!r}")
        return value


def _dtype_name(value: Any) -> str | None:
    """ "float16" for torch.float16, numpy.dtype("float16") or TileLang's T.float16, None for anything else (imports neither)."""
    module = type(value).__module__.split(".")[0]
    if module == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if module == "tvm_ffi" and type(value).__name__ == "dtype":
        return str(value)  # TileLang's T.float16
    if module == "numpy" and hasattr(value, "itemsize") and isinstance(getattr(value, "name", None), str) and not isinstance(value, type):
        return value.name  # numpy.dtype("float16") (a numpy.dtypes.Float16DType)
    return None


def plain(value: Any, want: type) -> Any:
    """What ML code passes, as the JSON-plain value a canonical spec holds: numpy integers and
    floats become int and float, numpy bools bool, torch and numpy dtypes their names
    ("float16"). Python bools stay bools: a size given as True is still refused."""
    if want is str:
        name = _dtype_name(value)
        return value if name is None else name
    if isinstance(value, (bool, str)) or value is None:
        return value
    if want is bool:
        return bool(value) if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_") else value
    if isinstance(value, numbers.Integral):
        return int(value)  # numpy.int64(4096) -> 4096; numpy bools are not Integral
    if want is float and isinstance(value, numbers.Real) and not isinstance(value, float):
        return float(value)  # numpy.float32
    if isinstance(value, float) and type(value) is not float:
        return float(value)  # numpy.float64, a float subclass
    return value


def plain_any(value: Any) -> Any:
    """plain() without a schema, for a kind this process does not know (the daemon validates it):
    dtypes become names, numpy numbers Python numbers, anything else stays as it is."""
    if _dtype_name(value) is not None:
        return _dtype_name(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, (bool, str, int, float)) or value is None:
        return plain(value, float) if isinstance(value, float) else value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def dim(name: str, doc: str = "", dynamic: bool = False) -> Param:
    """A tensor dimension: a positive int, or None for a runtime size when `dynamic`."""
    return Param(name, int, min=1, max=MAX_DIM, nullable=dynamic, doc=doc)


def dtype_param(doc: str = "element type of the tensors") -> Param:
    return Param("dtype", str, choices=DTYPES, doc=doc)


def tile(name: str, doc: str = "") -> Param:
    """An optional tiling knob; None means the kind's default for the target."""
    return Param(name, int, default=None, min=1, max=1024, nullable=True, doc=doc)


@dataclass(frozen=True)
class CanonicalSpec:
    """A validated signature with every default filled in: what a key is made of."""

    kind: str
    params: dict
    target: Target

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "params": self.params, "target": str(self.target)}, sort_keys=True, separators=(",", ":"))


class KernelKind:
    """A kernel family: a parameter schema plus a builder of TileLang PrimFuncs.

    Subclasses set `name`, `params` and `doc`, may override `check` for rules
    that involve several fields, and implement `build_cpu` / `build_cuda`,
    importing TileLang inside them (never at module level).
    """

    name: ClassVar[str]
    doc: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]]
    # Which PrimFunc parameters are outputs, in order (negative counts from the end);
    # a kind whose outputs depend on its params overrides `output_slots` too.
    outputs: ClassVar[tuple[int, ...]] = (-1,)
    # Small CUDA param sets a compile worker lowers at start: NVRTC then parses the
    # headers their generated source includes once, before any request needs them.
    warm_up: ClassVar[tuple[dict, ...]] = ()
    # Compile time relative to a GEMM's: a batch starts its longest compiles first,
    # so that none is left running alone at the end while other workers idle.
    compile_cost: ClassVar[float] = 1.0
    # Keyword arguments for TileLang's JITKernel beside the target: `pass_configs` and
    # `compile_flags` (a @tilelang.jit factory's decorator arguments: kernels.jit). They are
    # part of the kind's keys (registry.source_digest).
    compile_options: ClassVar[dict] = {}
    # What a build is and who loads it: "service", this service's entry (kernel.so and its call
    # ABI), loaded by the client without TileLang and served as a torch op; "tilelang", TileLang's
    # own cache entry, loaded by TileLang in the sender (kernels.program: TileLang's API, served).
    artifact: ClassVar[str] = "service"

    def canonicalize(self, raw: dict, target: Target) -> CanonicalSpec:
        known = {p.name for p in self.params}
        extra = sorted(set(raw) - known)
        if extra:
            raise InvalidSpec(extra[0], f"unknown parameter for kind {self.name!r}; it takes {', '.join(sorted(known))}")
        values = {}
        for p in self.params:
            if p.name in raw:
                values[p.name] = p.check(raw[p.name])
            elif p.default is REQUIRED:
                raise InvalidSpec(p.name, f"missing required parameter of kind {self.name!r}")
            else:
                values[p.name] = p.default
        if target.is_cpu:
            for p in self.params:
                if p.is_dtype and values[p.name] in DTYPES_16:
                    raise InvalidSpec(p.name, f"{values[p.name]} is not supported on target {target.describe()}; use float32")
        values = self.check(values, target) or values
        return CanonicalSpec(self.name, values, target)

    def check(self, p: dict, target: Target) -> dict | None:
        """Cross-field rules and default tilings; raise InvalidSpec, or return an updated dict."""
        return None

    def output_slots(self, p: dict) -> tuple[int, ...]:
        """The outputs of the PrimFunc for canonical params `p` (by default `outputs`)."""
        return self.outputs

    @property
    def multi_output(self) -> bool:
        """Whether some spec of the kind has several outputs: its torch op then returns a list
        (a kind whose count depends on its params sets this to True)."""
        return len(self.outputs) != 1

    def inplace(self, p: dict) -> dict[str, str]:
        """Outputs the kernel may write over one of its inputs, {output: input} by buffer name:
        every element of the output is written only after the elements of that input it
        depends on were read (row kernels, elementwise epilogues). It travels in the ABI
        (`abi.inplace`), so a client that never imports the kind takes that input as `out=`
        (an in-place update, e.g. a residual stream); any other overlap is refused."""
        return {}

    def writes(self, p: dict) -> tuple[str, ...]:
        """Inputs the kernel updates in place beside writing its outputs, by buffer name (a KV
        cache the new keys go into). They travel in the ABI (`abi.writes`). A torch op takes its
        inputs unmutated, so such a kernel is called directly, never through torch.compile/export."""
        return ()

    def scratch(self, p: dict) -> tuple[str, ...]:
        """PrimFunc buffers that are per-call workspaces, by name (split-K partials, split-KV
        log-sum-exps): the loader allocates them with torch.empty for each call (uninitialised,
        never zeroed, never returned), so a kernel must write every element it reads back.
        Their runtime dims must be dims of the inputs. They travel in the ABI (`abi.scratch`)."""
        return ()

    def host_side_dims(self, p: dict, target: Target) -> tuple[str, ...]:
        """Dims that reach only the host code on `target` (a grid size, a TMA descriptor), never
        the device code. tests/test_shared_builds.py lowers both forms to hold kinds to the claim."""
        return ()

    def dispatch(self, p: dict, target: Target) -> tuple[str, list[tuple[int | None, dict]]] | None:
        """Builds by range of one runtime dim, for a kind whose best kernel depends on its value
        (a GEMM's M: a few decode rows or thousands of prefill rows).

        Returns (dim, [(upper, overrides), ..., (None, overrides)]), upper bounds inclusive and
        increasing, for canonical params `p` that route on `dim`; None otherwise. `overrides`
        pin one range's build: `canonicalize({**p, **overrides, dim: None})` is a single build
        that runs correctly for every value of `dim` and fast in its range, and for which
        dispatch returns None. With `p[dim]` None and the choice left open, `p` is served by a
        router entry (abi.dispatch): the client loads every range's build and picks one per
        call. A static `p[dim]` is pinned by `check` to its range's overrides and served by a
        copy of that range's build (shared_build). Both ways each range is built once."""
        return None

    def routes(self, spec: CanonicalSpec) -> tuple[str, list[tuple[int | None, CanonicalSpec]]] | None:
        """(dim, [(upper, build spec), ...]) for a spec that `dispatch` serves through a router."""
        table = self._dispatch_table(spec)
        if table is None or spec.params[table[0]] is not None:
            return None
        dim, ranges = table
        return dim, [(upper, self._range_build(spec, dim, overrides)) for upper, overrides in ranges]

    def _dispatch_table(self, spec: CanonicalSpec) -> tuple[str, list[tuple[int | None, dict]]] | None:
        table = self.dispatch(dict(spec.params), spec.target)
        if table is None:
            return None
        dim, ranges = table
        uppers = [upper for upper, _ in ranges]
        if (
            dim not in spec.params
            or not ranges
            or uppers[-1] is not None
            or any(u is None or u < 1 for u in uppers[:-1])
            or uppers[:-1] != sorted(set(uppers[:-1]))
        ):
            raise TypeError(f"kind {self.name!r}: dispatch must name a dim and increasing inclusive upper bounds ending with None, got {table!r}")
        return dim, ranges

    def _range_build(self, spec: CanonicalSpec, dim: str, overrides: dict) -> CanonicalSpec:
        build = self.canonicalize({**spec.params, **overrides, dim: None}, spec.target)
        if self.dispatch(dict(build.params), build.target) is not None:  # it would route again, forever
            raise TypeError(f"kind {self.name!r}: the overrides {overrides!r} of a dispatch range leave the choice open")
        return build

    def shared_build(self, spec: CanonicalSpec) -> tuple[CanonicalSpec, dict] | None:
        """The build that serves `spec` with the same device code, and the dims `spec` fixes.

        That build leaves the host-side dims to run time, so one lowering and one device
        binary serve every value; the fixed dims are enforced by the loader. Otherwise a
        static value of a `dispatch` dim, pinned to its range's overrides, is served by that
        range's build, the one a router picks for it. None when `spec` is its own build.
        """
        fixed = {d: spec.params[d] for d in self.host_side_dims(spec.params, spec.target) if spec.params[d] is not None}
        table = self._dispatch_table(spec)
        if table is not None and table[0] not in fixed and spec.params[table[0]] is not None:
            dim, ranges = table
            value = spec.params[dim]
            overrides = next(o for upper, o in ranges if upper is None or value <= upper)
            if all(spec.params[k] == v for k, v in overrides.items()):
                return self._range_build(spec, dim, overrides), {dim: value}
        if not fixed:
            return None
        return self.canonicalize({**spec.params, **dict.fromkeys(fixed)}, spec.target), fixed

    def build(self, p: dict, target: Target):
        """The TileLang PrimFunc for canonical params `p` on `target`."""
        return self.build_cpu(p) if target.is_cpu else self.build_cuda(p, target)

    def build_cpu(self, p: dict):
        raise NotImplementedError

    def build_cuda(self, p: dict, target: Target):
        raise NotImplementedError

    def inputs(self, p: dict, randn, size) -> list:
        """Random inputs for canonical params `p`, in signature order (kernels.reference calls it):
        `randn(*shape, scale=1.0)` makes a tensor of the spec's dtype, `size(name)` resolves a
        dim that `p` leaves to run time."""
        raise NotImplementedError(f"kind {self.name!r} has no input maker")

    def reference(self, p: dict, x: list):
        """The expected output (a tuple for several outputs) from fp32 inputs `x`, in fp32
        (integer inputs, such as positions, stay integers)."""
        raise NotImplementedError(f"kind {self.name!r} has no torch reference")

    def source_files(self) -> list[str]:
        """The files whose source shapes this kind's kernels (kernels.registry.source_digest)."""
        import inspect

        return [inspect.getsourcefile(type(self))]

    def label(self, p: dict, target: Target) -> str | None:
        """A short name for a spec of this kind in logs and messages; None: its JSON."""
        return None

    def describe(self) -> dict:
        """The kind's schema as plain data: what ListKinds sends and `kernel-service kinds` prints."""
        return {"name": self.name, "doc": self.doc, "params": [field_doc(p) for p in self.params]}


def field_doc(p: Param) -> dict:
    out = {"name": p.name, "type": p.type_name, "doc": p.doc, "required": p.default is REQUIRED, "nullable": p.nullable}
    if p.default is not REQUIRED:
        out["default"] = p.default
    if p.choices:
        out["choices"] = list(p.choices)
    if p.min is not None:
        out["min"] = p.min
    if p.max is not None:
        out["max"] = p.max
    return out
