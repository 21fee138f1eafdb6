"""The fast call: a TVM-FFI kernel's call on plain CUDA tensors with out=None, as Python made for it.

TileLang's generated host code checks every argument in C++ before it launches (count, dtype,
rank, each size against the others, strides, device), and TileLang's own adapter relies on
that. The fast call checks in Python only what that code cannot see: tracing, plain tensors,
grad mode, that the first input is a CUDA tensor (meta tensors take the torch op), the sizes
a shared build's spec fixes, and that an input the kernel updates shares no memory with
another. (That every other tensor is on the first one's device is the library's check: a host
pointer never reaches a launch.) It allocates the outputs, each with `new_empty` of an input
of its dtype where there is one (no dtype or device to parse, as `torch.empty` has), and calls
the library.

Each kernel's call is generated once, on its first call, as straight-line code for its own
inputs and outputs: no loop, dict or list per call (a per-call loop over two tensors costs
more than the checks it makes; docs/measured.md#host-time-per-call). It answers CHECKED for any call it does not take; then
`Kernel.__call__` takes the checked path, which names the problem as on every other path, and
so does a call the library refused.
"""

from __future__ import annotations

import functools
import math

CHECKED = object()  # the fast call's answer when a call must take the checked path


@functools.cache
def plain_types() -> frozenset:
    """The tensor types a call runs on directly; any other (fake, meta-dispatching subclasses)
    goes through the torch op."""
    import torch

    return frozenset((torch.Tensor, torch.nn.Parameter))


def make(kernel):
    """`fast(kernel, inputs)` for `kernel` (a client.loader.Kernel), or None when every call of
    it takes the checked path (C kernels check nothing themselves). The code is generated on the
    first call, not at load: a warm start loads kernels it may never call."""
    if kernel.abi["loader"] != "tvm_ffi" or not kernel._inputs:
        return None
    return _first


def _first(kernel, inputs):
    kernel._fast = fast = _build(kernel)
    return CHECKED if fast is None else fast(kernel, inputs)


def _build(kernel):
    """The fast call of `kernel`, or None when a size of an output no input carries."""
    abi = kernel.abi
    params, fixed = abi["params"], abi.get("fixed", {})
    places: dict[str, tuple[int, int]] = {}  # runtime dim -> the first (input, axis) that carries it
    for pos, slot in enumerate(kernel._inputs):
        for axis, d in enumerate(params[slot]["shape"]):
            if isinstance(d, str):
                places.setdefault(d, (pos, axis))
    if "dispatch" in abi:
        dim = abi["dispatch"]["dim"]
        return None if dim not in places or dim in fixed else _router(len(kernel._inputs), *places[dim])
    allocs = [(slot, params[slot]["shape"]) for slot in (*kernel._outputs, *kernel._scratch)]
    if any(isinstance(d, str) and d not in places and d not in fixed for _, shape in allocs for d in shape):
        return None
    return _generate(kernel, places, fixed, allocs)


def _router(arity: int, pos: int, axis: int):
    """A router's fast call: the dispatch dim picks the build, whose own fast call runs it."""

    def fast(kernel, inputs):
        routes = kernel.routes  # read once: loading swaps the list whole
        if len(inputs) != arity or routes is None:
            return CHECKED
        try:
            size = inputs[pos].shape[axis]
        except IndexError:  # fewer dims than the ABI says
            return CHECKED
        for upto, build in routes:
            if upto is None or size <= upto:
                return CHECKED if build._fast is None else build._fast(build, inputs)
        return CHECKED

    return fast


def _generate(kernel, places: dict, fixed: dict, allocs: list):
    import torch

    n = len(kernel._inputs)
    names = [f"a{i}" for i in range(n)]
    used = {d for _, shape in allocs for d in shape if isinstance(d, str) and d not in fixed}
    read = {d: places[d] for d in used} | {d: places[d] for d in fixed if d in places}
    var = {d: f"d{i}" for i, d in enumerate(read)}  # the ABI's dim names never enter the source: any string is a name there
    body = [
        f"if len(inputs) != {n} or compiling():",
        "    return CHECKED",
        f"{', '.join(names)}, = inputs",
        "if " + " or ".join(f"type({a}) not in PLAIN" for a in names) + " or not a0.is_cuda:",
        "    return CHECKED",
        "if grad() and (" + " or ".join(f"{a}.requires_grad" for a in names) + "):",
        "    return CHECKED",
    ]
    if read:
        body.append("try:")
        body += [f"    {var[d]} = a{pos}.shape[{axis}]" for d, (pos, axis) in read.items()]
        body += ["except IndexError:  # fewer dims than the ABI says", "    return CHECKED"]
        checks = [f"{var[d]} != {int(v)}" for d, v in fixed.items() if d in places]
        if checks:
            body += [f"if {' or '.join(checks)}:", "    return CHECKED"]
    params = kernel.abi["params"]

    def nbytes(pos):  # a static shape's bytes are known now (a call whose shapes differ, the library refuses)
        slot = kernel._inputs[pos]
        shape = [fixed.get(d, d) for d in params[slot]["shape"]]
        return str(math.prod(shape) * kernel._dtypes[slot].itemsize) if all(isinstance(d, int) for d in shape) else f"{names[pos]}.nbytes"

    for name in kernel.writes:  # an updated input may not alias another: nothing below sees that
        wpos = kernel.input_names.index(name)
        body += [f"w, wn = {names[wpos]}.data_ptr(), {nbytes(wpos)}"]
        for pos in range(n):
            if pos != wpos:
                body += [f"x, xn = {names[pos]}.data_ptr(), {nbytes(pos)}", "if wn and xn and w < x + xn and x < w + wn:", "    return CHECKED"]
    args = {slot: names[pos] for pos, slot in enumerate(kernel._inputs)}
    consts = {"CHECKED": CHECKED, "PLAIN": plain_types()}
    consts |= {"compiling": torch.compiler.is_compiling, "grad": torch.is_grad_enabled, "empty": torch.empty, "fn": kernel._fn}
    like = {}  # dtype -> an input of that dtype
    for pos, slot in enumerate(kernel._inputs):
        like.setdefault(kernel._dtypes[slot], names[pos])
    for slot, shape in allocs:
        dims = ", ".join(str(int(fixed[d])) if d in fixed else var[d] if isinstance(d, str) else str(int(d)) for d in shape)
        dims = f"({dims}{',' if len(shape) == 1 else ''})"
        dtype = kernel._dtypes[slot]
        if dtype in like:
            body.append(f"o{slot} = {like[dtype]}.new_empty({dims})")
        else:
            consts[f"t{slot}"] = dtype
            body.append(f"o{slot} = empty({dims}, dtype=t{slot}, device=a0.device)")
        args[slot] = f"o{slot}"
    call = ", ".join(args[slot] for slot in range(len(kernel.abi["params"])))
    body += [
        "try:",
        f"    returned = fn({call})",
        "except Exception:",
        "    kernel.check_inputs(inputs)  # raises the checked path's error for what the library refused",
        "    raise",
        "if returned is not None:",
        "    raise kernel._own_outputs()",
    ]
    outs = [f"o{slot}" for slot in kernel._outputs]
    body.append(f"return {outs[0]}" if len(outs) == 1 else f"return ({', '.join(outs)})")  # () for none, as the checked path
    source = "def fast(kernel, inputs):\n" + "\n".join("    " + line for line in body) + "\n"
    scope = dict(consts)
    exec(compile(source, f"<fast call of {kernel.kind}>", "exec"), scope)  # noqa: S102 - our own text, from the checked ABI
    fast = scope["fast"]
    fast.source = source  # for a reader (and the tests): what a call runs
    return fast
