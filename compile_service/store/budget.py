"""The cache budget: how much the local store keeps, and least-recently-used eviction.

Every byte under the cache counts: entries' own records, the blobs they link
(each once, however many entries share it) and the device-binary cache the
compile workers keep (store.extra_usage). Recency is the store's
(LocalStore.last_used); a device binary's is its mtime. Eviction takes an entry
only through LocalStore.take_unused, which renames it away under the lock
lookups mark use under, and never takes one used within `min_age` seconds: a
client may be about to load it. Works on the store's public surface only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

from proto.entry import RECORDS
from proto.trust import problem

from .base import Budget

log = logging.getLogger(__name__)


def extra_files(store) -> list[tuple[float, Path, int]]:
    """(mtime, path, size) of every file in the extra caches (device binaries); locks excluded.

    Walked without following a link: a top that is a link, or not a directory of the store's
    owner that only it may write, is skipped with a warning (never walked, never evicted from)."""
    out = []
    for top in store.extra_usage:
        try:
            why = problem(os.lstat(top), store.owner)
        except FileNotFoundError:
            continue
        if why:
            log.warning("not counting or evicting %s: it %s", top, why)
            continue
        for dirpath, dirnames, names, dirfd in os.fwalk(top, follow_symlinks=False):
            dirnames[:] = [d for d in dirnames if d != "locks"]
            for name in names:
                if name.endswith(".lock"):
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out.append((st.st_mtime, Path(dirpath) / name, st.st_size))
    return out


def _own_bytes(path: Path) -> int:
    """An entry's own record (entry.json, manifest.json), not the blobs it links."""
    return sum(os.lstat(path / name).st_size for name in RECORDS)


def _freed_by_removal(path: Path) -> int:
    """Bytes an entry's removal frees: its record, and blobs no other entry links."""
    freed = 0
    for f in path.iterdir():
        st = f.lstat()
        if f.name in RECORDS or st.st_nlink <= 2:  # this entry and the blob itself
            freed += st.st_size
    return freed


def usage(store) -> tuple[int, int]:
    """(entries, bytes) on disk now."""
    entries = size = 0
    for key in store.keys():
        with contextlib.suppress(OSError):  # evicted while we walk
            size += _own_bytes(store.entry_path(key))
            entries += 1
    size += store.blobs.usage() + sum(f[2] for f in extra_files(store))
    return entries, size


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
        items = [(mtime, "device", path, size) for mtime, path, size in extra_files(store)]
        for key in store.keys():
            with contextlib.suppress(OSError):  # vanished meanwhile
                items.append((store.last_used(key), "entry", key, 0))
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
            if store.take_unused(item, cutoff):
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
