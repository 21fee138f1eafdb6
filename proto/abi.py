"""The call ABI of a built kernel, defined once here.

The compiler writes it (compile_service.build.compiler), the scheduler adds the
sizes a shared build's copy fixes, every reader of an entry checks it (through
proto.entry, which owns the entry and its entry.json), and the client's loader
calls the library by it. An ABI, as JSON:

    {"loader":  "c" | "tvm_ffi",     how the library is called (ctypes C function, TVM-FFI module)
     "symbol":  "call",              the function to call in the library
     "device":  "cpu" | "cuda",      where its tensors live
     "params":  [{"name": "X", "dtype": "float16", "shape": ["M", 4096]}, ...],
                                     every tensor in call order; a str dim is a runtime size
     "outputs": [2],                 indices into params the caller allocates and gets back
     "dynamic": [{"name": "M", "dtype": "int32"}],
                                     runtime sizes in the order the C loader passes them
     "fixed":   {"M": 256},          optional: runtime dims this spec fixes (a shared build's copy)
     "inplace": {"C": "R"},          optional: outputs the kernel may write over an input of the same
                                     shape and dtype (KernelKind.inplace), by param name: the client
                                     takes that input as `out=`, an in-place update
     "writes":  [4, 5],              optional: indices into params of inputs the kernel updates in
                                     place (KernelKind.writes; a KV cache): called directly only
     "scratch": [3],                 optional: indices into params of per-call workspaces
                                     (KernelKind.scratch) the loader allocates uninitialised for each
                                     call and never returns; their runtime dims come from the inputs
     "dispatch": {"dim": "M", "routes": [{"upto": 16, "spec": SPEC}, ..., {"upto": null, "spec": SPEC}]}}
                                     optional: a router (KernelKind.dispatch): the client loads each
                                     route's build (a canonical spec: kind, params, target) and calls,
                                     per call, the first whose inclusive `upto` bounds the runtime dim

A TileLang program sent as IR (kernels.program) is built as TileLang's own cache entry and
loaded by TileLang in its sender (`JITKernel.from_database`), which reads its parameters from
the entry's files. Its ABI only says which files those are:

    {"loader":  "tilelang",
     "backend": "tvm_ffi" | "cython",  TileLang's execution backend (its adapter)
     "device":  "cpu" | "cuda",
     "symbol":  "main",                the PrimFunc's global symbol
     "files":   {"device_source": "device_kernel.cu", "host_source": "host_kernel.cu", "params": "params.json"}}
"""

from __future__ import annotations

LOADERS = {"c": "cpu", "tvm_ffi": "cuda"}  # loader -> the device its tensors live on
FIELDS = {"loader": str, "symbol": str, "device": str, "params": list, "outputs": list, "dynamic": list}
C_INT_DTYPES = ("int32", "int64")
PROGRAM = "tilelang"  # the loader of TileLang programs' entries
PROGRAM_BACKENDS = ("tvm_ffi", "cython")
PROGRAM_FILES = ("device_source", "host_source", "params")


class AbiError(ValueError):
    """An ABI or entry metadata that a loader could not safely call."""


def make(
    loader: str,
    symbol: str,
    params: list[dict],
    outputs: list[int],
    dynamic: list[dict],
    inplace: dict[str, str] | None = None,
    scratch: list[int] | None = None,
    writes: list[int] | None = None,
) -> dict:
    abi = {"loader": loader, "symbol": symbol, "device": LOADERS.get(loader, "?"), "params": params, "outputs": outputs, "dynamic": dynamic}
    if inplace:
        abi["inplace"] = dict(inplace)
    if writes:
        abi["writes"] = list(writes)
    if scratch:
        abi["scratch"] = list(scratch)
    check(abi)
    return abi


def program(backend: str, device: str, symbol: str, files: dict[str, str]) -> dict:
    """The ABI of a TileLang program's entry: TileLang's backend and which files hold what."""
    abi = {"loader": PROGRAM, "backend": backend, "device": device, "symbol": symbol, "files": dict(files)}
    check(abi)
    return abi


def _check_program(abi: dict) -> None:
    if set(abi) != {"loader", "backend", "device", "symbol", "files"}:
        raise AbiError("a TileLang program's abi has exactly loader, backend, device, symbol and files")
    if abi["backend"] not in PROGRAM_BACKENDS or abi["device"] not in ("cpu", "cuda") or not isinstance(abi["symbol"], str):
        raise AbiError(f"abi.backend {abi['backend']!r} with device {abi['device']!r} is not a TileLang program's")
    files = abi["files"]
    if not isinstance(files, dict) or set(files) != set(PROGRAM_FILES) or not all(isinstance(name, str) for name in files.values()):
        raise AbiError(f"abi.files must name a file for each of {', '.join(PROGRAM_FILES)} (proto.entry checks the names)")


def with_fixed(abi: dict, fixed: dict[str, int]) -> dict:
    """The ABI of a copy of a shared build whose spec fixes some of its runtime dims
    (beside those the build, itself a copy, may fix)."""
    out = {**abi, "fixed": {**abi.get("fixed", {}), **fixed}}
    check(out)
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(abi) -> None:
    """Raises AbiError unless `abi` is one the loader can call."""
    if not isinstance(abi, dict):
        raise AbiError("abi is not a mapping")
    if abi.get("loader") == PROGRAM:
        return _check_program(abi)
    for name, kind in FIELDS.items():
        if not isinstance(abi.get(name), kind):
            raise AbiError(f"abi.{name} is missing or not a {kind.__name__}")
    if abi["loader"] not in LOADERS or abi["device"] != LOADERS[abi["loader"]]:
        raise AbiError(f"abi.loader {abi['loader']!r} with device {abi['device']!r} is not a known pairing")
    names = set()
    for p in abi["params"]:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not isinstance(p.get("dtype"), str) or not isinstance(p.get("shape"), list):
            raise AbiError("abi.params entries need a name, a dtype and a shape")
        if not all(isinstance(d, str) or (_is_int(d) and d >= 0) for d in p["shape"]):
            raise AbiError(f"abi.params[{p['name']}].shape holds something other than sizes and dim names")
        names.update(d for d in p["shape"] if isinstance(d, str))
    n = len(abi["params"])
    if not all(_is_int(i) and 0 <= i < n for i in abi["outputs"]) or len(set(abi["outputs"])) != len(abi["outputs"]):
        raise AbiError("abi.outputs must be distinct indices into abi.params")
    for d in abi["dynamic"]:
        if not isinstance(d, dict) or d.get("name") not in names or d.get("dtype") not in C_INT_DTYPES:
            raise AbiError("abi.dynamic entries must name a dim of the params, with an int32 or int64 dtype")
    scratch = abi.get("scratch", [])
    if not isinstance(scratch, list) or not all(_is_int(i) and 0 <= i < n for i in scratch) or len(set(scratch)) != len(scratch):
        raise AbiError("abi.scratch must be distinct indices into abi.params")
    if set(scratch) & set(abi["outputs"]):
        raise AbiError("abi.scratch and abi.outputs must not share a param")
    writes = abi.get("writes", [])
    if not isinstance(writes, list) or not all(_is_int(i) and 0 <= i < n for i in writes) or len(set(writes)) != len(writes):
        raise AbiError("abi.writes must be distinct indices into abi.params")
    if set(writes) & (set(scratch) | set(abi["outputs"])):
        raise AbiError("abi.writes must name inputs, not outputs or scratch")
    bound = {d for i, p in enumerate(abi["params"]) if i not in scratch and i not in abi["outputs"] for d in p["shape"] if isinstance(d, str)}
    for i in scratch:  # the loader sizes a workspace from the inputs' runtime dims
        if not {d for d in abi["params"][i]["shape"] if isinstance(d, str)} <= bound:
            raise AbiError(f"abi.scratch {abi['params'][i]['name']!r} has a runtime dim no input binds")
    if "dispatch" in abi:
        _check_dispatch(abi["dispatch"], abi)
    fixed = abi.get("fixed", {})
    if not isinstance(fixed, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in fixed.items()):
        raise AbiError("abi.fixed is not a mapping of dims to ints")
    inplace = abi.get("inplace", {})
    if not isinstance(inplace, dict):
        raise AbiError("abi.inplace is not a mapping of output names to input names")
    by_name = {p["name"]: (i, p) for i, p in enumerate(abi["params"])}
    for out, into in inplace.items():
        o, i = by_name.get(out), by_name.get(into)
        if o is None or i is None or o[0] not in abi["outputs"] or i[0] in abi["outputs"]:
            raise AbiError(f"abi.inplace {out!r} -> {into!r} must name an output and an input")
        if (o[1]["dtype"], o[1]["shape"]) != (i[1]["dtype"], i[1]["shape"]):
            raise AbiError(f"abi.inplace {out!r} -> {into!r}: an output can be written only over an input of its shape and dtype")


def _check_dispatch(dispatch, abi: dict) -> None:
    if not isinstance(dispatch, dict) or dispatch.get("dim") not in {d["name"] for d in abi["dynamic"]}:
        raise AbiError("abi.dispatch must name one of the ABI's runtime dims")
    routes = dispatch.get("routes")
    if not isinstance(routes, list) or not routes:
        raise AbiError("abi.dispatch.routes must be a non-empty list")
    for r in routes:
        spec = r.get("spec") if isinstance(r, dict) else None
        if not isinstance(spec, dict) or not all(isinstance(spec.get(f), t) for f, t in (("kind", str), ("params", dict), ("target", str))):
            raise AbiError("abi.dispatch.routes entries need a spec with a kind, params and a target")
    uppers = [r.get("upto") for r in routes]
    if uppers[-1] is not None or not all(_is_int(u) and u >= 1 for u in uppers[:-1]) or uppers[:-1] != sorted(set(uppers[:-1])):
        raise AbiError("abi.dispatch.routes must have increasing int bounds (upto) and end with null")


def with_routes(abi: dict, dim: str, routes: list[tuple[int | None, dict]]) -> dict:
    """The ABI of a router: a copy of its last route's build that names every route's spec."""
    out = {**abi, "dispatch": {"dim": dim, "routes": [{"upto": upto, "spec": spec} for upto, spec in routes]}}
    check(out)
    return out
