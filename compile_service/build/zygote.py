"""The compile workers' zygote: multiprocessing's forkserver imports this module once, and every
worker forks from it with TileLang and the kernel kinds already imported (workers.process_pool).

Only imports run here, and the zoo's source digests are read right after its import, so that a
worker's builds record the source it runs (Scheduler checks them). Nothing touches NVRTC or a GPU, and no thread is started: a fork copies
the calling thread alone, so each worker sets up its own device compiler and precompiled
headers (compiler.worker_init) after the fork.
"""

from __future__ import annotations

import os

# TileLang's import asks torch whether CUDA is there. NVML answers without initialising the CUDA
# driver in this process, whose state a forked worker could not use.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# Workers are TileLang's compiler, never a client of the service (client/tilelang_hook.py): a
# daemon started with KERNEL_SERVICE_TILELANG=1 must not route its own builds back to itself.
os.environ["KERNEL_SERVICE_TILELANG"] = "0"

import tilelang  # noqa: E402, F401

import kernels  # noqa: E402

from . import compiler  # noqa: E402, F401

kernels.registry.digest_sources()
