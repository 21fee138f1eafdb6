"""Cache keys: the canonical spec plus a fingerprint of everything that shapes the binary.

Pure and cheap: a key never traces the TileLang DSL. It holds no path, host
name, user or process id, so every host with the same toolchain computes the
same keys. Bump SCHEMA when the layout or meaning of an entry changes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from importlib import metadata

import kernels
from kernels.spec import CanonicalSpec

SCHEMA = 3  # 3: each kind's own source digest; entry files stored once as blobs


@functools.cache
def tilelang_version() -> str:
    try:
        return metadata.version("tilelang")
    except metadata.PackageNotFoundError:
        return "none"


def toolchain(kind: str, target_kind: str, cuda_compiler: str | None) -> dict:
    """What besides the spec decides the compiled bytes of one kind on one target kind.
    `cuda_compiler`: the device compiler's id ("nvrtc-13.0"), recorded for CUDA only."""
    return {
        "schema": SCHEMA,
        "tilelang": tilelang_version(),
        "cuda_compiler": cuda_compiler if target_kind == "cuda" else None,
        "machine": platform.machine(),
        "kind_source": kernels.source_digest(kind)[:16],
    }


def describe_toolchain(cuda_compiler: str) -> str:
    return f"schema={SCHEMA} tilelang={tilelang_version()} cuda={cuda_compiler} machine={platform.machine()}"


def cache_key(spec: CanonicalSpec, cuda_compiler: str) -> str:
    """Hex sha256 of the canonical spec and the toolchain fingerprint."""
    blob = json.dumps({"spec": spec.to_json(), "toolchain": toolchain(spec.kind, spec.target.kind, cuda_compiler)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
