"""Cache keys, defined once for both sides: sha256 of the canonical spec and a toolchain fingerprint.

The daemon keys the entries it publishes with it (compile_service.keys supplies
its toolchain); a client computes the same keys from the fingerprint the daemon
reports once (ServiceInfo.key_fingerprint_json), so it can find a published
entry on disk without asking. Pure and cheap: no path, host name, user or
process id goes in, so every host with the same toolchain computes the same keys.
"""

from __future__ import annotations

import hashlib
import json

SCHEMA = 3  # 3: each kind's own source digest; entry files stored once as blobs. Bump when an entry's layout or meaning changes.
KIND_SOURCE_CHARS = 16  # of a kind's hex source digest, in keys: 64 bits tell its versions apart


def fingerprint(tilelang: str, cuda_compiler: str | None, machine: str, kind_digests: dict[str, str]) -> dict:
    """What besides the spec goes into a daemon's keys, for the kinds of `kind_digests` (kind -> its
    full source digest): the form the daemon reports (ServiceInfo.key_fingerprint_json) and `toolchain` reads."""
    return {
        "schema": SCHEMA,
        "tilelang": tilelang,
        "cuda_compiler": cuda_compiler,
        "machine": machine,
        "kind_sources": {kind: digest[:KIND_SOURCE_CHARS] for kind, digest in kind_digests.items()},
    }


def toolchain(fingerprint: dict, kind: str, target_kind: str) -> dict:
    """What besides the spec decides the compiled bytes of `kind` on a target kind ("c", "cuda"),
    from a `fingerprint`.
    Raises KeyError for a kind the fingerprint does not cover."""
    return {
        "schema": fingerprint["schema"],
        "tilelang": fingerprint["tilelang"],
        "cuda_compiler": fingerprint["cuda_compiler"] if target_kind == "cuda" else None,
        "machine": fingerprint["machine"],
        "kind_source": fingerprint["kind_sources"][kind],
    }


def cache_key(spec_json: str, toolchain: dict) -> str:
    """Hex sha256 of a canonical spec (CanonicalSpec.to_json()) and its toolchain."""
    blob = json.dumps({"spec": spec_json, "toolchain": toolchain}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
