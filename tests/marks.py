"""Skip marks for what a test needs from the machine: nvcc or NVRTC to cross-compile CUDA
kernels, a GPU to run them."""

from __future__ import annotations

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
