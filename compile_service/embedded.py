"""The service inside the calling process, with no daemon: the client's fallback.

This is the daemon package's one public entry point for in-process use. It
runs the daemon's own scheduler and store on the same cache (one build ->
publish path: shared builds, remembered failures and the layout are the
daemon's), with compiles in this process rather than in spawned workers (an
agent's script may not be safe to re-import), and a file lock per key so that
processes without a daemon still compile each kernel once.
"""

from __future__ import annotations

import atexit
import functools
import threading
from pathlib import Path

from filelock import FileLock

from kernels.spec import CanonicalSpec
from proto.wire import Outcome

from . import explain
from .build import devices
from .build.compiler import CompileFailed
from .keys import toolchain
from .layout import counted_dirs
from .scheduler import NotReady, Scheduler, in_process_pool
from .store import Entry, LocalStore, StoreError, existing_mode

__all__ = ["CompileFailed", "EmbeddedService", "NotReady", "StoreError", "embedded"]


class EmbeddedService:
    def __init__(self, cache_dir: Path | str, cuda_compiler: str | None = None):
        root = Path(cache_dir)
        self.store = LocalStore(root, existing_mode(root), extra_usage=counted_dirs(root))
        self.locks = root / "locks"
        self.locks.mkdir(mode=0o700, exist_ok=True)
        # The worker (TileLang's import) starts with the first compile: a strict client never needs it.
        self.scheduler = Scheduler(self.store, self.store.claims, workers=1, device=devices.choose(cuda_compiler), pool=in_process_pool, start=False)
        self._started = threading.Lock()
        atexit.register(self.scheduler.shutdown, 10.0)  # idle drivers stop at once; a running compile gets 10 s

    def get(self, spec: CanonicalSpec, compile: bool = True) -> tuple[Entry, str]:
        """The entry of `spec` (built here if no process has built it, and `compile`) and how it
        was satisfied: "hit" or "compiled". Raises CompileFailed, StoreError or NotReady."""
        key = self.scheduler.key_of(spec)
        entry = self.store.lookup(key)
        if entry is not None:
            return entry, Outcome.HIT.label
        if not compile:
            why = explain.explain(self.store, spec, key, toolchain(spec.kind, spec.target.kind, self.scheduler.device.id)).reason
            raise NotReady(spec, key, f"the request asked for no compile (a strict client; no daemon answered); {why}")
        if self._started.acquire(blocking=False):  # held for good once taken: start once
            self.scheduler.start_workers()
        with FileLock(str(self.locks / f"{key}.lock"), mode=0o600):  # filelock would chmod 0644
            future, outcome = self.scheduler.request(spec)
            return future.result(), outcome.label


@functools.cache
def embedded(cache_dir: str) -> EmbeddedService:
    """One embedded service per cache root and process."""
    return EmbeddedService(cache_dir)
