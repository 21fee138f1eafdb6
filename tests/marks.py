"""Skip marks for what a test needs from the machine: nvcc or NVRTC to cross-compile CUDA
kernels, a GPU to run them, a redis-server for the fleet tier."""

from __future__ import annotations

import os
import shutil

import pytest

from compile_service.build import nvrtc


def _gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="cross-compiling CUDA kernels needs nvcc")
needs_gpu = pytest.mark.skipif(not _gpu(), reason="running CUDA kernels needs a GPU")
needs_nvrtc = pytest.mark.skipif(nvrtc.unavailable_reason() is not None, reason=str(nvrtc.unavailable_reason()))


def require_redis_server() -> None:
    """Skips the calling test where redis-server is not installed, except in CI: CI installs it
    (.ci/run), so there its absence fails the test."""
    if shutil.which("redis-server") is not None:
        return
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed, and CI must run the fleet tests: .ci/run installs it (apt-get install redis-server)")
    pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; `make test` installs it when run as root)")
