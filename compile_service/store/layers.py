"""Read-only cache layers: caches baked into an image or mounted read-only, served as they are.

A layer is a cache root as the local store writes it (store.local's layout; `bundle import
--layer` lays a bundle out as one), made read-only. `serve --cache-layer PATH` (repeatable, or
$KERNEL_SERVICE_CACHE_LAYERS) names them. A lookup tries the writable cache first, then each
layer in order, and a hit is served from where it lies: the entry directory a reply names is
the layer's, never a copy.

A layer is never written, whatever its permissions say (a daemon run as root could): no
recency bookkeeping (the writable cache touches an entry's mtime on a hit; a layer's hits are
not counted for eviction, which never looks at a layer), no removal. A damaged entry, found on
a lookup or reported by a client, is refused for as long as the daemon runs, with a warning;
the writable cache then gets its own build when the daemon may compile. Eviction, `prune`,
`clear` and `verify` know only the writable cache.

Trust: a layer belongs to root or the daemon's uid (whichever owns its root, proto.trust's
layer_owner), and every directory and file of it that is read must be that uid's and writable
by no one else, as in the writable cache. A layer that fails this at start stops the daemon
with one line naming the layer and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

from proto.entry import ENTRY_META, Entry, signature
from proto.paths import entry_dir
from proto.trust import check_dir, layer_owner, read_owned

from ..fsutil import real_dir
from .base import Budget, Storage
from .local import LocalStore, read_entry

log = logging.getLogger(__name__)

LAYER_FIX = "make the layer (and everything in it) owned by root or by the daemon's uid and writable by no one else, or leave out that --cache-layer"


def is_layer(root: Path | str) -> bool:
    """Whether the cache root at `root` is a read-only layer: a real directory its owner may not
    write (a layer's directories are 0555). Root may write anything: the commands that remove
    entries (clear, prune, verify --repair) ask this first."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IWUSR


class Layer:
    """One read-only cache root: its entries looked up and checked as the writable cache's are."""

    def __init__(self, root: Path | str, metrics=None):
        """Raises UntrustedPath when the root or its entries/ is a link, is owned by neither root
        nor this process's uid, or is writable by group or others; FileNotFoundError when it is
        not a cache."""
        self.root = Path(root)
        if not os.path.lexists(self.root):
            raise FileNotFoundError(
                f"cache layer {self.root} does not exist; build it (`kernel-service bundle import --layer`) or leave out that --cache-layer"
            )
        self.owner = layer_owner(self.root, os.geteuid(), LAYER_FIX)
        entries = self.root / "entries"
        if not os.path.lexists(entries):
            raise FileNotFoundError(
                f"cache layer {self.root} is not a kernel cache (no entries/ directory); build it with `kernel-service bundle import --layer`"
            )
        check_dir(entries, self.owner, "cache layer directory", LAYER_FIX)
        self.metrics = metrics
        self._index: dict[str, tuple[Entry, tuple, tuple]] = {}  # key -> (entry, file names, stat signature) when checked
        self._refused: set[str] = set()  # keys whose entry failed a check: a layer is not repaired while we run
        self._lock = threading.Lock()

    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        """The checked entry for `key`, or None (missing, or refused: then never served)."""
        path = entry_dir(self.root, key)
        with self._lock:
            cached = self._index.get(key)
            if key in self._refused:
                return None
        if cached is None and not os.path.lexists(path):
            return None
        if cached is not None:
            entry, names, sig = cached
            with suppress(OSError):
                if signature(path, names) == sig and (spec is None or entry.meta["spec"] == spec):
                    return entry
        return self._check(key, trusted=cached[2] if cached else None, spec=spec)[0]

    def holds(self, key: str) -> bool:
        return os.path.lexists(entry_dir(self.root, key))

    def recheck(self, key: str) -> str | None:
        """Checks the entry in full (every file re-hashed), as if never seen: a client found it
        corrupt. A failure refuses it from then on; returns what was wrong, or None."""
        with self._lock:
            self._index.pop(key, None)
        return self._check(key, reported=True)[1]

    def _check(self, key: str, trusted: tuple | None = None, spec: dict | None = None, reported: bool = False) -> tuple[Entry | None, str | None]:
        path = entry_dir(self.root, key)
        try:
            found = read_entry(key, path, self.owner, trusted, spec)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not os.path.lexists(path):
                return None, None
            self._refuse(key, f"reported by a client; {exc}" if reported else str(exc))
            return None, str(exc)
        with self._lock:
            self._index[key] = found
        return found[0], None

    def _refuse(self, key: str, why: str) -> None:
        log.warning(
            "cache layer %s: entry %s is corrupt or not trusted (%s); not serving it (a layer is never changed: rebuild the layer)", self.root, key[:16], why
        )
        if self.metrics is not None:
            self.metrics.add(corrupt=1)
        with self._lock:
            self._refused.add(key)
            self._index.pop(key, None)

    def records(self):
        """Every entry's key and entry.json, read without verifying the entry (for explain)."""
        entries = self.root / "entries"
        for shard in entries.iterdir() if real_dir(entries) else ():
            for path in shard.iterdir() if real_dir(shard) else ():
                try:
                    meta = json.loads(read_owned(path / ENTRY_META, self.owner))
                except (OSError, ValueError):
                    continue
                if isinstance(meta, dict):
                    yield path.name, meta


class Layered(Storage):
    """The writable cache, then read-only layers in order: a lookup serves what it finds first,
    from where it lies. Everything that writes, evicts or counts is the writable cache's alone."""

    def __init__(self, writable: LocalStore, layers: Iterable[Layer]):
        self.writable = writable
        self.layers = tuple(layers)
        self.root = writable.root  # where builds are staged and published (and the workers' device-binary cache)

    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        entry = self.writable.lookup(key, spec)
        for layer in self.layers:
            if entry is not None:
                break
            entry = layer.lookup(key, spec)
        return entry

    def recheck(self, key: str) -> str | None:
        """As LocalStore.recheck for the entry a lookup would serve: a layer's is refused, never removed."""
        if os.path.lexists(self.writable.entry_path(key)):
            return self.writable.recheck(key)
        for layer in self.layers:
            if layer.holds(key):
                return layer.recheck(key)
        return None

    def records(self):
        yield from self.writable.records()
        for layer in self.layers:
            yield from layer.records()

    # ----- the writable cache's alone
    def new_staging(self, key: str) -> Path:
        return self.writable.new_staging(key)

    def discard_staging(self, staging: Path) -> None:
        self.writable.discard_staging(staging)

    def put(self, key: str, staging: Path, library: str, meta: dict, **how) -> Entry:
        return self.writable.put(key, staging, library, meta, **how)

    def remove(self, key: str) -> None:
        self.writable.remove(key)

    def usage(self) -> tuple[int, int]:
        return self.writable.usage()

    def evict(self, budget_: Budget, protect: str | None = None) -> int:
        return self.writable.evict(budget_, protect)

    def close(self) -> None:
        self.writable.close()
