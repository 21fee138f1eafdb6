"""Where built kernels live: an interface (base), the local disk store, and its parts by job.

    base     the Storage interface, Entry, Budget, Claim, StoreError
    local    the local disk store: index, lookup, atomic publish
    blobs    the content store: file bytes by sha256, shared by entries through hard links
    budget   usage and least-recently-used eviction (device binaries included)
    check    verify and repair, without the index
    tiered   the fleet tier: the local store over a shared Redis (read-through, write-behind,
             fleet-wide single flight); imported only when a daemon is given --remote
    remote   the Redis side of it: key layout, leases, the circuit breaker
"""

from .base import BUILD, Budget, Claim, Entry, Storage, StoreError
from .local import LocalStore, existing_mode

__all__ = ["BUILD", "Budget", "Claim", "Entry", "LocalStore", "Storage", "StoreError", "existing_mode"]
