"""What every store offers the scheduler: the interface, the entry it hands out, its error.

A store is an action cache (key -> a small metadata record) over a content
store (file bytes by sha256). The local disk is one implementation
(store.local); the fleet tier (store.tiered) wraps it under the same interface,
and adds `claim`: before compiling a key, the scheduler asks whether another
host has built it, is building it, or saw it fail.
"""

from __future__ import annotations

import abc
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


class StoreError(OSError):
    """The cache could not be written (disk full, permissions): not a compile failure."""


@dataclass(frozen=True)
class Entry:
    """One published kernel: where its files are, the library's digest, its entry.json."""

    key: str
    path: Path
    library: str
    library_sha256: str
    library_size: int
    meta: dict  # entry.json: spec, abi, compile_seconds, toolchain, created (proto.abi)

    @property
    def abi(self) -> dict:
        return self.meta["abi"]

    # Serialized once per entry (entries are cached and immutable), not once per hit.
    @functools.cached_property
    def abi_json(self) -> str:
        return json.dumps(self.meta["abi"], sort_keys=True)

    @functools.cached_property
    def spec_json(self) -> str:
        return json.dumps(self.meta["spec"], sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Budget:
    """How big the cache may grow; None means unbounded."""

    max_bytes: int | None = None
    max_entries: int | None = None
    min_age: float = 300.0  # never evict an entry handed out this recently (seconds)

    @property
    def bounded(self) -> bool:
        return self.max_bytes is not None or self.max_entries is not None


@dataclass(frozen=True)
class Claim:
    """The answer to "may I build this key?". All fields empty: build it."""

    entry: Entry | None = None  # built elsewhere and now published here: serve it
    failure: str | None = None  # failed elsewhere: answer with it, remembered `failure_ttl` more seconds
    failure_ttl: float = 0.0
    waiting: bool = False  # another host is building it: `wake` is called once that is over


BUILD = Claim()


class Storage(abc.ABC):
    """The store interface: lookup, staged put, removal, budget and usage; and the claim on a
    key before building it, for stores shared with other builders."""

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
    def recheck(self, key: str) -> str | None:
        """Checks `key`'s entry in full, whatever was verified before (a client found it corrupt),
        and removes it if it fails; returns what was wrong, or None (whole or absent)."""

    @abc.abstractmethod
    def keys(self) -> list[str]: ...

    def records(self) -> Iterator[tuple[str, dict]]:
        """Every entry's key and metadata (entry.json: spec, toolchain), for diagnostics
        (explain). A store may read them unverified; this default verifies each."""
        for key in self.keys():
            entry = self.lookup(key)
            if entry is not None:
                yield key, entry.meta

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(entries, bytes) now: every byte the store keeps counts, and shared bytes once."""

    @abc.abstractmethod
    def evict(self, budget: Budget, protect: str | None = None) -> int:
        """Removes least recently used entries down to `budget`; returns how many."""

    # ----- builds shared with other hosts (a store nobody else writes answers trivially)
    def claim(self, key: str, spec: dict, wake: Callable[[], None]) -> Claim:
        """Asked before building `key` (whose entry must record `spec`), after a local miss.
        When the answer is `waiting`, `wake()` is called later, once: ask again then."""
        return BUILD

    def abandon(self, key: str, failure: str | None = None, failure_ttl: float = 0.0) -> None:
        """The build of a claimed key ended without an entry: `failure` (the compiler's message)
        when it failed, to be remembered `failure_ttl` seconds; None when it was cut short."""

    def close(self) -> None:
        """Finishes background work (bounded) and lets go of what the store holds for others."""
