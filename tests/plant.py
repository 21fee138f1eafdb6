"""Entries planted in a cache through the store's own put(): a spec and toolchain of the test's
choosing (another TileLang release, another CUDA compiler), published like a build would be.
Nothing here loads them; the bytes of the library are the test's."""

from __future__ import annotations

import json
import os

import kernels
from compile_service.keys import toolchain
from compile_service.store import LocalStore
from proto import keys
from proto.entry import LIBRARY


def abi(target: str) -> dict:
    cpu = target == "c"
    return {
        "loader": "c" if cpu else "tvm_ffi",
        "symbol": "call" if cpu else "main",
        "device": "cpu" if cpu else "cuda",
        "params": [{"name": "X", "dtype": "float32", "shape": ["M", 64]}, {"name": "Y", "dtype": "float32", "shape": ["M", 64]}],
        "outputs": [1],
        "dynamic": [{"name": "M", "dtype": "int32"}],
    }


def spec_of(kind: str, target: str, **params) -> dict:
    """The canonical spec (as entry.json records it) of a valid request."""
    return json.loads(kernels.canonicalize(kind, params, target).to_json())


def host_toolchain(spec: dict, cuda_compiler: str) -> dict:
    return toolchain(spec["kind"], "c" if spec["target"] == "c" else "cuda", cuda_compiler)


def key_of(spec: dict, toolchain_: dict) -> str:
    """The key of a spec (as entry.json records it) built with `toolchain_`."""
    return keys.cache_key(json.dumps(spec, sort_keys=True, separators=(",", ":")), toolchain_)


def plant(store: LocalStore, spec: dict, toolchain_: dict, library: bytes | None = None) -> str:
    """Publishes an entry recording `spec` built with `toolchain_`, under the key those give."""
    key = key_of(spec, toolchain_)
    staging = store.new_staging(key)
    (staging / LIBRARY).write_bytes(library if library is not None else os.urandom(256))
    meta = {"spec": spec, "abi": abi(spec["target"]), "toolchain": toolchain_, "compile_seconds": 0.5, "created": 0.0}
    store.put(key, staging, LIBRARY, meta)
    return key
