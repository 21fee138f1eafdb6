"""The cache budget: how much the local store keeps, and least-recently-used eviction.

Every byte under the cache counts: entries' own records, the blobs they link
(each once, however many entries share it) and the device-binary cache the
compile workers keep (store.extra_usage). Recency: when an entry was last
handed out, from this store's memory and from its directory's mtime, which
clients that find entries themselves set, and which a store sets at most once
a minute (TOUCH_EVERY) on a hit: where this process never handed an entry out
(another daemon, `kernel-service prune`), its last use may lie up to
TOUCH_EVERY past the mtime, and is taken to. A device binary's is its mtime.
Eviction renames an entry away before deleting it, under the lock lookups mark
use under, and never takes one used within `min_age` seconds: a client may be
about to load it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from pathlib import Path

from proto.abi import ENTRY_META, MANIFEST

from ..fsutil import remove_tree
from .base import Budget

TOUCH_EVERY = 60.0  # seconds between a store's mtime touches of an entry it hands out (store.local)

log = logging.getLogger(__name__)


def _extra_files(store) -> list[tuple[float, Path, int]]:
    """(mtime, path, size) of every file in the extra caches (device binaries); locks excluded."""
    out = []
    for top in store.extra_usage:
        for dirpath, dirnames, names in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "locks"]
            for name in names:
                if name.endswith(".lock"):
                    continue
                path = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    st = path.lstat()
                    if stat.S_ISREG(st.st_mode):
                        out.append((st.st_mtime, path, st.st_size))
    return out


def _own_bytes(path: Path) -> int:
    """An entry's own record (entry.json, manifest.json), not the blobs it links."""
    return sum(os.lstat(path / name).st_size for name in (ENTRY_META, MANIFEST))


def _freed_by_removal(path: Path) -> int:
    """Bytes an entry's removal frees: its record, and blobs no other entry links."""
    freed = 0
    for f in path.iterdir():
        st = f.lstat()
        if f.name in (ENTRY_META, MANIFEST) or st.st_nlink <= 2:  # this entry and the blob itself
            freed += st.st_size
    return freed


def usage(store) -> tuple[int, int]:
    """(entries, bytes) on disk now."""
    entries = size = 0
    for key in store.keys():
        with contextlib.suppress(OSError):  # evicted while we walk
            size += _own_bytes(store.entry_path(key))
            entries += 1
    size += store.blobs.usage() + sum(f[2] for f in _extra_files(store))
    return entries, size


def _last_used(store, key: str, path: Path) -> float:
    """When the entry was last used, at the latest. Call under store._lock or not: a stale
    read only makes an entry look older than it is by the time the rename checks again."""
    mtime = path.stat().st_mtime  # set at publish; touched by hits and by clients that load it themselves
    used = store._used.get(key)
    return max(used, mtime) if used is not None else mtime + TOUCH_EVERY


def _take_unused(store, key: str, cutoff: float) -> bool:
    """Removes the entry unless it was handed out after `cutoff`. The check and the rename
    happen under the lock lookups mark use under, so a hit never gets an entry being evicted."""
    path = store.entry_path(key)
    trash = store.staging_dir / f"{os.getpid()}.trash.{key}.{os.urandom(4).hex()}"
    with store._lock:
        try:
            if _last_used(store, key, path) > cutoff:
                return False
            os.rename(path, trash)
        except OSError:
            return False
        for table in (store._index, store._used, store._touched):
            table.pop(key, None)
    remove_tree(trash)
    return True


def evict(store, budget: Budget, protect: str | None = None) -> int:
    """Removes least recently used entries (and device binaries) until the cache fits `budget`;
    returns how many entries went.

    Entries handed out (or published) within `min_age` seconds, and `protect`, are kept even
    if the cache stays over budget. Runs alongside hits and publishes: a concurrent pass
    just returns 0.
    """
    if not budget.bounded or not store.evict_lock.acquire(blocking=False):
        return 0
    try:
        count, total = usage(store)
        if (budget.max_entries is None or count <= budget.max_entries) and (budget.max_bytes is None or total <= budget.max_bytes):
            return 0
        items = [(mtime, "device", path, size) for mtime, path, size in _extra_files(store)]
        for key in store.keys():
            path = store.entry_path(key)
            with contextlib.suppress(OSError):  # vanished meanwhile
                with store._lock:
                    used = _last_used(store, key, path)
                items.append((used, "entry", key, 0))
        removed = 0
        cutoff = time.time() - budget.min_age
        for used, what, item, size in sorted(items, key=lambda i: i[0]):
            over_entries = budget.max_entries is not None and count > budget.max_entries
            over_bytes = budget.max_bytes is not None and total > budget.max_bytes
            if not (over_entries or over_bytes):
                break
            if used > cutoff:
                continue  # handed out recently: a client may be about to load it
            if what == "device":
                if not over_bytes:
                    continue  # device binaries count in bytes, never in entries
                with contextlib.suppress(OSError):
                    item.unlink()
                    total -= size
                continue
            if item == protect:
                continue
            try:
                freed = _freed_by_removal(store.entry_path(item))
            except OSError:
                continue
            if _take_unused(store, item, cutoff):
                count, total, removed = count - 1, total - freed, removed + 1
        if removed:
            store.blobs.collect()
            count, total = usage(store)  # measured: blobs that removed entries shared are freed only by collect
            if store.metrics is not None:
                store.metrics.add(evictions=removed)
            log.info("evicted %d least recently used entries; cache now %d entries, %d bytes", removed, count, total)
        return removed
    finally:
        store.evict_lock.release()
