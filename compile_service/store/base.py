"""What every store offers the scheduler: storage, claims on builds, the entry, the error.

A store is an action cache (key -> a small metadata record) over a content
store (file bytes by sha256): lookup, put, remove, usage, records (Storage). The local
disk is its implementation (store.local). Claiming a build is apart (Claims):
before compiling a key after a local miss, the scheduler asks whether another
builder has built it, is building it, or saw it fail. A store no one else
writes answers "build it" (LocalClaims); a fleet answers through Redis
(store.tiered.FleetClaims), which also shares what this host publishes, through
the store's publish hook.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proto.entry import Entry  # one published kernel: defined with the entry's rules

__all__ = ["BUILD", "Budget", "Claim", "Claims", "Entry", "LocalClaims", "Storage", "StoreError"]


class StoreError(OSError):
    """The cache could not be written (disk full, permissions): not a compile failure."""


@dataclass(frozen=True)
class Budget:
    """How big the cache may grow; None means unbounded."""

    max_bytes: int | None = None
    max_entries: int | None = None
    min_age: float = 300.0  # never evict an entry handed out this recently (seconds)

    @property
    def bounded(self) -> bool:
        return self.max_bytes is not None or self.max_entries is not None


class Storage(abc.ABC):
    """The store interface: lookup, a staged put, removal and usage."""

    root: Path

    @abc.abstractmethod
    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        """The verified entry for `key`, or None. A damaged entry is a miss (and removed), never
        an error; `spec`, when given, must equal the spec the entry records."""

    @abc.abstractmethod
    def new_staging(self, key: str) -> Path:
        """A private directory to build `key`'s files in."""

    @abc.abstractmethod
    def discard_staging(self, staging: Path) -> None: ...

    @abc.abstractmethod
    def put(self, key: str, staging: Path, library: str, meta: dict) -> Entry:
        """Publishes `staging` as `key`'s entry, whole or not at all; raises StoreError."""

    @abc.abstractmethod
    def remove(self, key: str) -> None: ...

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(entries, bytes) now: every byte the store keeps counts, and shared bytes once."""

    @abc.abstractmethod
    def records(self):
        """Every entry's key and entry.json, read without verifying the entry (explain; whether
        the cache holds any kernel at all). Serving always goes through lookup."""


@dataclass(frozen=True)
class Claim:
    """The answer to "may I build this key?". All fields empty: build it."""

    entry: Entry | None = None  # built elsewhere and now published here: serve it
    failure: str | None = None  # failed elsewhere: answer with it, remembered `failure_ttl` more seconds
    failure_ttl: float = 0.0
    waiting: bool = False  # another host is building it: `wake` is called once that is over
    tier_error: str | None = None  # fetch only: why the builders could not be asked (naming where they are)


BUILD = Claim()


class Claims(abc.ABC):
    """Claims on builds: asked before building a key, told when a claimed build ended without an entry."""

    @abc.abstractmethod
    def claim(self, key: str, spec: dict, wake: Callable[[], None]) -> Claim:
        """Asked before building `key` (whose entry must record `spec`), after a local miss.
        When the answer is `waiting`, `wake()` is called later, once: ask again then."""

    def fetch(self, key: str, spec: dict) -> Claim | None:
        """Asked on a miss that may not be built here (a serve-only host, a strict request):
        the entry another builder published (read through and published here, as `claim`
        does), its failure, or `waiting` when one is building it now; never takes a lease,
        never waits. An empty Claim: no builder has it; `tier_error` set: they could not be
        asked. None: there are no other builders to ask."""
        return None

    def abandon(self, key: str, failure: str | None = None, failure_ttl: float = 0.0) -> None:
        """The build of a claimed key ended without an entry: `failure` (the compiler's message)
        when it failed, to be remembered `failure_ttl` seconds; None when it was cut short."""

    def close(self) -> None:
        """Finishes background work (bounded) and lets go of what is held for others."""


class LocalClaims(Claims):
    """The claims of a store no other builder writes: every key is this host's to build
    (this daemon's own single flight keeps it to one build)."""

    def claim(self, key: str, spec: dict, wake: Callable[[], None]) -> Claim:
        return BUILD
