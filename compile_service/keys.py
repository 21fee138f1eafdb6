"""Cache keys: the canonical spec plus a fingerprint of everything that shapes the binary.

Pure and cheap: a key never traces the TileLang DSL. Bump SCHEMA when the
layout or meaning of an entry changes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from importlib import metadata

import kernels
from kernels.spec import CanonicalSpec

SCHEMA = 2  # 2: the CUDA compiler (nvcc or NVRTC) is part of the key

NVCC, NVRTC = "nvcc", "nvrtc"


@functools.cache
def nvcc_version() -> str:
    """nvcc's release (e.g. "13.0.88"), or "none" when there is no nvcc."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "none"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"V(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


@functools.cache
def tilelang_version() -> str:
    try:
        return metadata.version("tilelang")
    except metadata.PackageNotFoundError:
        return "none"


@functools.cache
def cuda_compiler_id(cuda_compiler: str) -> str:
    """The device compiler and its release, as recorded in keys, entries and stats: "nvrtc-13.0", "nvcc-13.0.88"."""
    if cuda_compiler == NVRTC:
        from . import nvrtc

        return f"nvrtc-{nvrtc.version()}"
    return f"nvcc-{nvcc_version()}"


@functools.cache
def toolchain(target_kind: str, cuda_compiler: str = NVCC) -> dict:
    """What besides the spec decides the compiled bytes, for one target kind."""
    return {
        "schema": SCHEMA,
        "tilelang": tilelang_version(),
        "cuda_compiler": cuda_compiler_id(cuda_compiler) if target_kind == "cuda" else None,
        "machine": platform.machine(),
        "kernels": kernels.source_digest()[:16],
    }


def describe_toolchain(cuda_compiler: str = NVCC) -> str:
    tc = toolchain("cuda", cuda_compiler)
    return f"schema={tc['schema']} tilelang={tc['tilelang']} cuda={tc['cuda_compiler']} kernels={tc['kernels']}"


def cache_key(spec: CanonicalSpec, cuda_compiler: str = NVCC) -> str:
    """Hex sha256 of the canonical spec and the toolchain fingerprint."""
    blob = json.dumps({"spec": spec.to_json(), "toolchain": toolchain(spec.target.kind, cuda_compiler)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
