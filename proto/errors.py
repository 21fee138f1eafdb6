"""The contract's own errors, defined here so that every layer above can raise and catch them.

    InvalidSpec    a kernel signature that cannot be built (the wire's INVALID_ARGUMENT)
    EntryRefused   a cache entry, or one of its records, that fails the entry's rules
                   (proto.entry, proto.trust): never served, never loaded

Imports nothing: the ground floor of the ground floor.
"""

from __future__ import annotations


class InvalidSpec(ValueError):
    """A kernel signature that cannot be built; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EntryRefused(OSError):
    """A cache entry (its directory, files, manifest, entry.json, fleet index or bundle record)
    that fails a check: refused, with what failed. The client raises it as CorruptArtifact."""
