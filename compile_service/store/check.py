"""Checking the local store without its index, and repairing what is damaged (`kernel-service verify`).

Works on the store's public surface: the entry check is the store's own (LocalStore.check_entry,
proto.entry's rules), removal goes through LocalStore.remove_path.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from proto.entry import is_key

from ..fsutil import real_dir
from .local import LocalStore, is_staging_name, writer_alive


@dataclass
class Damage:
    """One problem `verify` found: a bad entry, a leftover staging dir or a stray file."""

    what: str  # "entry", "staging" or "stray"
    path: Path
    why: str
    repaired: bool = False


@dataclass
class VerifyReport:
    entries_ok: int = 0
    damage: list[Damage] = field(default_factory=list)
    staging_in_use: int = 0  # staging dirs whose writer is alive: left alone

    @property
    def unrepaired(self) -> list[Damage]:
        return [d for d in self.damage if not d.repaired]


def verify(store: LocalStore, repair: bool = False) -> VerifyReport:
    """Checks every entry against its manifest (sizes, digests, required files), without the
    in-memory index, and finds staging directories left by dead writers and stray files.

    Read-only unless `repair`; then removes exactly what is damaged, and only staging
    directories whose writer is dead. Safe while a daemon serves the same cache: an
    entry that vanishes or is replaced while being checked is not damage.
    """
    report = VerifyReport()
    for shard in sorted(store.entries_dir.iterdir()):
        paths = sorted(shard.iterdir()) if shard.is_dir() and not shard.is_symlink() else [shard]
        for path in paths:
            why, ino = _damage(store, path)
            if why is None:
                report.entries_ok += ino is not None
                continue
            damage = Damage("stray" if ino is None else "entry", path, why)
            report.damage.append(damage)
            if repair:
                damage.repaired = _repair(store, path, ino)
    for item in sorted(store.staging_dir.iterdir()):
        if is_staging_name(item.name) and writer_alive(item.name):
            report.staging_in_use += 1
            continue
        made = is_staging_name(item.name) and real_dir(item) and item.lstat().st_uid == store.owner
        damage = Damage("staging", item, "left by a writer that is gone" if made else "not made by kernel-service")
        report.damage.append(damage)
        if repair:
            damage.repaired = _repair(store, item, None)
    return report


def _damage(store: LocalStore, path: Path) -> tuple[str | None, int | None]:
    """(what is wrong or None, the entry dir's inode or None when it is no entry dir)."""
    key = path.name
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None, None  # removed meanwhile (evicted or repaired by the daemon)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (never followed)", None
    if not stat.S_ISDIR(st.st_mode) or path.parent == store.entries_dir:
        return "not a shard directory", None
    if not is_key(key) or path != store.entry_path(key):
        return "not an entry directory named by its key", None
    try:
        store.check_entry(key)
    except FileNotFoundError as exc:
        return (f"incomplete: {Path(exc.filename).name} is missing" if path.exists() else None), st.st_ino
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return (f"corrupt: {exc}" if path.exists() else None), st.st_ino
    return None, st.st_ino


def _repair(store: LocalStore, path: Path, ino: int | None) -> bool:
    """Removes one damaged thing; an entry dir only if it is still the one checked."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return True
    if ino is not None and st.st_ino != ino:
        return True  # replaced by a fresh publish since it was checked: that one is whole
    store.remove_path(path)
    return not os.path.lexists(path) or (ino is not None and path.lstat().st_ino != ino)
