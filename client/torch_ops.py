"""Served kernels as torch custom ops: torch.compile (fullgraph, dynamic shapes), CUDA graphs, torch.export.

One op per kernel kind, in the namespace `kernel_service`, with two overloads:

    kernel_service::<kind>(str spec, Tensor[] inputs) -> Tensor               (Tensor[] if the kind has several outputs)
    kernel_service::<kind>.out(str spec, Tensor[] inputs, *, Tensor(a!)[] out) -> ()

`spec` is the kernel's canonical spec as JSON (`Kernel.spec_json`, the client's
memo key): a constant string in a traced graph, so a graph or an exported
program names every kernel it calls completely, and any process can resolve it.
Resolution (`kernel_for`, client/resolver.py) is memoized per process: a kernel
this process loaded through any client, else `client.get_kernel` on the default
connection ($KERNEL_SERVICE_SOCKET), which a warm cache answers without compiling.

Why per kind, with the spec as an argument: an op per built kernel would put
thousands of ops, named by hashes, in one namespace, each to be registered
again before a saved program could even be loaded; one op for everything would
show every kernel as the same `call` in graphs and profiles. Per kind, a graph
reads `kernel_service.gemm(...)`, profiles group by kind, and the set of ops is
fixed by the kinds the client knows (registered at import; a kind registered
later gets its ops when its first kernel loads).

The fake (meta) implementation runs the loader's own input checks on fake
tensors and allocates outputs from the ABI: runtime dims (a dynamic M) stay
symbolic, static dims specialize (guard) to the ABI's values, so a compiled
function recompiles only where a kernel's sizes demand it. The real
implementations allocate outputs with torch.empty (PyTorch's caching allocator)
and launch on the current stream, so CUDA-graph capture, plain or through
torch.compile(mode="reduce-overhead"), records them. The Autograd kernel refuses
inputs that would record grad: the kernels are inference-only.

Importing this module imports torch and registers the ops of every known kind;
`import client` has it imported once torch is (before or after the client: client/when_imported.py),
and loading any kernel does:
the client binds each kernel it loads to its kind's op (`bind`).
"""

from __future__ import annotations

import threading

import torch

import kernels

from .loader import INFERENCE_ONLY, Kernel
from .resolver import kernel_for, remember

NAMESPACE = "kernel_service"

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_ops: dict[str, tuple] = {}  # kind -> (default overload, out overload)
_returns_list: dict[str, bool] = {}  # kind -> whether its op returns a list
_lock = threading.RLock()


def _layout_tag() -> list:
    # Inductor must hand the kernels dense row-major inputs, never its padded-stride buffers.
    for name in ("needs_contiguous_strides", "needs_exact_strides", "needs_fixed_stride_order"):
        if hasattr(torch.Tag, name):
            return [getattr(torch.Tag, name)]
    return []


def _kernel(kind: str, spec_json: str) -> Kernel:
    kernel = kernel_for(spec_json)
    if kernel.kind != kind:
        raise ValueError(f"kernel_service::{kind} called with a spec of kind {kernel.kind!r}")
    if kernel.writes:  # the op's schema says its inputs are not mutated: tracing would reorder or drop the writes
        raise RuntimeError(
            f"{kind}: this kernel updates its inputs {', '.join(kernel.writes)} in place, which the op kernel_service::{kind} "
            "cannot declare; call it with plain tensors outside torch.compile / torch.export"
        )
    return kernel


def _check_grad(kind: str, spec_json: str, inputs, outs=()) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *outs)):
        kernel = _kernel(kind, spec_json)  # only now: for the names in the message
        kernel.check_grad(inputs)
        for name, t in zip(kernel.output_names, outs):
            if t.requires_grad:
                raise RuntimeError(INFERENCE_ONLY.format(name=f"out {name}", kind=kind))


def register_kind(kind: str, n_outputs: int = 1, multi: bool | None = None) -> tuple:
    """Defines kernel_service::<kind> and its .out overload (once per process); returns both overloads.

    The op returns a list when `multi` (default: `n_outputs` is not 1): a kind whose output count
    depends on its params (layernorm with `residual`) always returns a list, of one or more.
    Kinds this process imports are registered with the client; a kind only the daemon
    serves (a plugin) gets its ops when its first kernel loads. A fresh process that
    loads a saved program calling such a kind registers it first: register_kind(name)."""
    multi = n_outputs != 1 if multi is None else multi
    with _lock:
        if kind in _ops:
            if n_outputs != 1 and not _returns_list[kind]:  # a list op takes any count
                raise ValueError(f"kernel_service::{kind} was registered for 1 output, this kernel has {n_outputs}")
            return _ops[kind]
        if not kind.isidentifier():
            raise ValueError(f"kind {kind!r} cannot name a torch op (not an identifier)")
        _lib.define(f"{kind}(str spec, Tensor[] inputs) -> {'Tensor[]' if multi else 'Tensor'}", tags=_layout_tag())
        _lib.define(f"{kind}.out(str spec, Tensor[] inputs, *, Tensor(a!)[] out) -> ()", tags=_layout_tag())
        packet = getattr(getattr(torch.ops, NAMESPACE), kind)
        default, out_op = packet.default, packet.out

        def impl(spec, inputs):
            result = _kernel(kind, spec).run(inputs)
            if not multi:
                return result
            return list(result) if isinstance(result, tuple) else [result]

        def impl_out(spec, inputs, *, out):
            _kernel(kind, spec).run(inputs, out)

        def fake(spec, inputs):
            kernel = _kernel(kind, spec)
            dims, device = kernel.check_inputs(inputs)  # on fake tensors: static dims guard, runtime dims stay symbolic
            device = device or torch.device(kernel.abi["device"])
            outs = kernel.empty_outputs(dims, device)
            return outs if multi else outs[0]

        def fake_out(spec, inputs, *, out):
            kernel = _kernel(kind, spec)
            dims, device = kernel.check_inputs(inputs)
            kernel.check_out(out, dims, device)

        def autograd(spec, inputs):
            _check_grad(kind, spec, inputs)
            with torch._C._AutoDispatchBelowAutograd():
                return default(spec, inputs)

        def autograd_out(spec, inputs, *, out):
            _check_grad(kind, spec, inputs, out)
            with torch._C._AutoDispatchBelowAutograd():
                out_op(spec, inputs, out=out)
            for t in out:  # what ADInplaceOrView would do: saved tensors see the write
                if not t.is_inference():
                    torch.autograd.graph.increment_version(t)

        for key in ("CPU", "CUDA"):
            _lib.impl(kind, impl, key)
            _lib.impl(f"{kind}.out", impl_out, key)
        _lib.impl(kind, autograd, "Autograd")
        _lib.impl(f"{kind}.out", autograd_out, "Autograd")
        torch.library.register_fake(f"{NAMESPACE}::{kind}", fake, lib=_lib)
        torch.library.register_fake(f"{NAMESPACE}::{kind}.out", fake_out, lib=_lib)
        _ops[kind] = (default, out_op)
        _returns_list[kind] = multi
        return _ops[kind]


def bind(kernel: Kernel) -> Kernel:
    """Gives a freshly loaded kernel its kind's two overloads (registering them on first use)
    and makes it its spec's kernel here, unless one was loaded first; returns it. A kernel
    whose outputs the op of its name cannot return (a same-named kind of another daemon
    registered it first) loads without an op: plain calls run, traced ones say why not."""
    known = kernels.kinds().get(kernel.kind)
    try:
        kernel.bind_op(*register_kind(kernel.kind, len(kernel.output_names), known.multi_output if known is not None else None))
    except ValueError as exc:  # another kind of the same name (another daemon's plugin) holds the op: plain calls still run
        kernel.leave_unbound(str(exc))
    remember(kernel)
    return kernel


def register_all() -> None:
    """Registers the ops of every kind this process knows."""
    for name, kind in kernels.kinds().items():
        if kind.artifact == "service":  # TileLang loads its own programs: no op
            register_kind(name, len(kind.outputs), kind.multi_output)


register_all()

__all__ = ["NAMESPACE", "bind", "kernel_for", "register_all", "register_kind", "remember"]
