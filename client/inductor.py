"""Points this process's torch.compile at the daemon's persistent Inductor directory.

Precedence (the XDG convention in DESIGN.md):
  1. TORCHINDUCTOR_CACHE_DIR already set by the user: it wins, untouched.
  2. The daemon's directory (<cache root>/torchinductor), when a daemon answers.
  3. Otherwise the directory a daemon would keep on the client's cache root
     (`cache_dir=`, else $KERNEL_SERVICE_CACHE_DIR, else $XDG_CACHE_HOME/kernel-service
     or ~/.cache/kernel-service): <root>/torchinductor, created owner-only.
Only TORCHINDUCTOR_CACHE_DIR is set: Inductor then puts Triton's cache under
it (<dir>/triton/<device>), as it does by default, unless TRITON_CACHE_DIR is set.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from proto.paths import inductor_dir

log = logging.getLogger(__name__)
ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class InductorCache:
    path: Path
    source: str  # "environment", "daemon" or "fallback"

    def __fspath__(self) -> str:
        return str(self.path)


def _already_compiled() -> bool:
    """Has torch.compile produced (or looked up) a graph in this process yet?"""
    if "torch._dynamo" not in sys.modules:
        return False
    counters = sys.modules["torch._dynamo"].utils.counters
    return any(counters["inductor"].get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"))


def use_shared_inductor_cache(daemon_dir, cache_root: Path) -> InductorCache:
    """`daemon_dir()` returns the daemon's directory or raises ConnectionError; with no daemon,
    the directory is the one under `cache_root`."""
    if _already_compiled():
        warnings.warn(
            f"use_shared_inductor_cache() was called after torch.compile already compiled in this process; "
            f"those graphs went to {os.environ.get(ENV)}. Call it before the first torch.compile.",
            RuntimeWarning,
            stacklevel=3,
        )
    existing = os.environ.get(ENV)
    if existing:
        log.info("%s is already set to %s; keeping it", ENV, existing)
        return InductorCache(Path(existing), "environment")
    try:
        result = InductorCache(Path(daemon_dir()), "daemon")
    except ConnectionError as exc:
        path = inductor_dir(cache_root)
        cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)  # as a daemon would create it: owner-only
        path.mkdir(mode=0o700, exist_ok=True)
        log.warning("no kernel service answered (%s); using %s for torch.compile's cache", exc, path)
        result = InductorCache(path, "fallback")
    os.environ[ENV] = str(result.path)
    log.info("torch.compile's Inductor cache: %s (%s)", result.path, result.source)
    return result
