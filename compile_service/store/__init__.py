"""Where built kernels live: the interfaces (base), the local disk store, and its parts by job.

    base     the Storage and Claims interfaces, Entry, Budget, Claim, StoreError
    local    the local disk store: index, lookup, atomic publish, the publish hook
    blobs    the content store: file bytes by sha256, shared by entries through hard links
    budget   usage and least-recently-used eviction (device binaries included)
    check    verify and repair, without the index
    listing  what the store holds, entry by entry (`kernel-service ls`)
    layers   read-only cache layers (serve --cache-layer), looked up after the local store, never written
    tiered   the fleet form of claims: fleet-wide single flight over a shared Redis, read-through
             (for builders and for hosts that may not build), and write-behind as the local
             store's publish hook; imported only with --remote
    remote   the Redis side of it: key layout, leases, the circuit breaker, each call's byte budget
    resp     Redis replies read within that budget, counted on the socket

The rules of an entry itself (key, file names, manifest, entry.json, the fleet index's and
bundle.json's records) are the contract's: proto.entry.
"""

from .base import BUILD, Budget, Claim, Claims, Entry, LocalClaims, Storage, StoreError
from .local import LocalStore, existing_mode

__all__ = ["BUILD", "Budget", "Claim", "Claims", "Entry", "LocalClaims", "LocalStore", "Storage", "StoreError", "existing_mode"]
