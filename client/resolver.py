"""Which kernel a canonical spec names in this process (the torch ops' spec argument).

The first kernel loaded for a spec is its kernel here (`remember`); a spec no loaded kernel
answers, as in a fresh process running a saved program, is fetched through the resolver the
client installs (`set_resolver`: the default connection's get_kernel, see client/api.py).
The client passes it in, so that this module and client/torch_ops.py never import the client
that imports them. Light: no torch.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from .loader import Kernel

Resolve = Callable[[str, str, dict], Kernel]  # (kind, target, params) -> the loaded kernel

_kernels: dict[str, Kernel] = {}  # canonical spec JSON -> the loaded kernel
_lock = threading.Lock()
_resolve: Resolve | None = None


def set_resolver(resolve: Resolve) -> None:
    """How a spec that no kernel loaded in this process answers is fetched."""
    global _resolve
    _resolve = resolve


def remember(kernel: Kernel) -> Kernel:
    """Makes `kernel` the one its spec resolves to in this process (the first loaded wins)."""
    with _lock:
        return _kernels.setdefault(kernel.spec_json, kernel)


def kernel_for(spec_json: str) -> Kernel:
    """The kernel a spec names: one loaded in this process, else fetched through the resolver."""
    kernel = _kernels.get(spec_json)
    if kernel is not None:
        return kernel
    try:
        spec = json.loads(spec_json)
        kind, target, params = spec["kind"], spec["target"], dict(spec["params"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"kernel_service op: not a canonical kernel spec: {spec_json[:200]!r} ({exc})") from None
    if _resolve is None:
        raise RuntimeError(f"kernel_service op: no kernel for {spec_json[:200]} is loaded in this process, and nothing installed a resolver (import client)")
    kernel = _resolve(kind, target, params)
    if kernel.spec_json != spec_json:  # a spec from another version of the kernels: not what the graph meant
        raise ValueError(f"kernel_service op: spec {spec_json} canonicalizes to {kernel.spec_json} in this process (another version of the kernels?)")
    return remember(kernel)


__all__ = ["Resolve", "kernel_for", "remember", "set_resolver"]
