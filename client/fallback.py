"""In-process compile when no daemon answers, into the same cache the daemon uses.

Runs the daemon's own build path in this process (compile_service.embedded), so
the entry under a key is the same whoever built it. Needs TileLang in this
process; the daemon path never does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import kernels
from proto import channel
from proto.paths import default_cache_dir
from proto.wire import Status

from . import loader


def build_locally(spec: kernels.CanonicalSpec, cache_dir: str | os.PathLike | None = None, compile: bool = True) -> loader.Kernel:
    """The kernel from the cache, built here first if it is not there and `compile`."""
    from compile_service.embedded import CompileFailed, NotReady, StoreError, embedded

    service = embedded(str(Path(cache_dir) if cache_dir else default_cache_dir()))
    what = f"kernel {spec.kind}"  # raised as the daemon's answer for it would be (proto.channel)
    try:
        entry, outcome = service.get(spec, compile)
    except NotReady as exc:
        raise channel.error_from(Status.NOT_READY, str(exc), what) from None
    except CompileFailed as exc:
        raise channel.error_from(Status.COMPILE_FAILED, str(exc), what) from None
    except StoreError as exc:
        raise channel.error_from(Status.CACHE_FAILED, f"kernel cache write failed: {exc.strerror or exc}", what) from None
    # Checked like a daemon's answer: only this process's own files, under its cache root.
    asked = loader.answered(entry.key, entry.path, entry.library, entry.library_sha256, entry.library_size, json.loads(spec.to_json()), entry.abi)
    record = loader.KernelRecord(asked, outcome, entry.meta.get("compile_seconds", 0.0))
    return loader.load(record, root=service.store.root, owner=service.store.owner)
