"""What agents import to get TileLang kernels from the kernel service.

    import client
    gemm = client.get_kernel("gemm", M=None, N=4096, K=4096, dtype="float16", target="auto")
    C = gemm(A, B)

Light to import: no TileLang, no compiler, and torch only once the caller has it.
See README for the full API.
"""

import os

import proto.clashes  # noqa: F401  (checks for a foreign `proto` or `kernels`: where proto-plus's __init__.py replaced ours, ours did not)

from .api import Client, connect, default_client, explain, get_kernel, kinds, prefetch, stats
from .api import use_shared_inductor_cache_default as use_shared_inductor_cache
from .inductor import InductorCache
from . import errors
from .errors import *  # noqa: F403  (the exceptions: errors.__all__)
from .loader import Kernel
from .pending import PendingPrefetch
from .tilelang import install_tilelang_cache, uninstall_tilelang_cache
from .when_imported import when_imported


def _register_torch_ops() -> None:
    from . import torch_ops  # noqa: F401  (its import registers the ops)


# The kernels' torch ops (torch.compile, torch.export) once torch is imported, before or after this
# package, so that a saved program loads in either order; a kernel's load registers them too. A
# process started with KERNEL_SERVICE_TILELANG=1 imports this package as TileLang's cache
# (client/tilelang_hook.py): it registers the ops at its first zoo kernel, not at TileLang's import.
if os.environ.get("KERNEL_SERVICE_TILELANG") != "1":
    when_imported("torch", _register_torch_ops)

__all__ = [
    *errors.__all__,
    "Client",
    "InductorCache",
    "Kernel",
    "PendingPrefetch",
    "connect",
    "default_client",
    "explain",
    "get_kernel",
    "install_tilelang_cache",
    "kinds",
    "prefetch",
    "stats",
    "uninstall_tilelang_cache",
    "use_shared_inductor_cache",
]
