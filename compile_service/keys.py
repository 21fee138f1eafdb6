"""The daemon's side of cache keys: its toolchain fingerprint (proto.keys defines the key).

Never traces the TileLang DSL. The fingerprint is what GetServiceInfo reports, so
that clients compute the same keys.
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata

import kernels
from kernels.spec import CanonicalSpec
from proto import keys
from proto.keys import SCHEMA

__all__ = ["SCHEMA", "cache_key", "describe_toolchain", "fingerprint", "tilelang_version", "toolchain"]


@functools.cache
def tilelang_version() -> str:
    try:
        return metadata.version("tilelang")
    except metadata.PackageNotFoundError:
        return "none"


def _fingerprint(cuda_compiler: str | None, kinds: list[str]) -> dict:
    return keys.fingerprint(tilelang_version(), cuda_compiler, platform.machine(), {kind: kernels.source_digest(kind) for kind in kinds})


def fingerprint(cuda_compiler: str) -> dict:
    """Everything besides the spec that goes into this daemon's keys, for every registered kind."""
    return _fingerprint(cuda_compiler, sorted(kernels.kinds()))


def toolchain(kind: str, target_kind: str, cuda_compiler: str | None) -> dict:
    """What besides the spec decides the compiled bytes of one kind on one target kind.
    `cuda_compiler`: the device compiler's id ("nvrtc-13.0"), recorded for CUDA only."""
    return keys.toolchain(_fingerprint(cuda_compiler, [kind]), kind, target_kind)


def describe_toolchain(cuda_compiler: str) -> str:
    return f"schema={SCHEMA} tilelang={tilelang_version()} cuda={cuda_compiler} machine={platform.machine()}"


def cache_key(spec: CanonicalSpec, cuda_compiler: str) -> str:
    """Hex sha256 of the canonical spec and the toolchain fingerprint."""
    return keys.cache_key(spec.to_json(), toolchain(spec.kind, spec.target.kind, cuda_compiler))
