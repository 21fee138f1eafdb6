"""The contract between the daemon and its clients; both import it, neither imports the other.

    kernelservice/v1/   the wire format (.proto and its generated stubs): the API reference
    errors.py           the contract's errors: InvalidSpec, EntryRefused
    entry.py            the cache entry: key and file-name rules, manifest, entry.json, the fleet
                        index's and bundle.json's records, their checks, Entry, the stat signature
    abi.py              the call ABI a published kernel carries
    keys.py             cache keys: the canonical spec and a toolchain fingerprint, hashed
    memo.py             a bounded memo, for answers that repeat (both sides keep some)
    manifest.py         manifests: the kernels an application needs, and application names
    wire.py             specs <-> proto, request limits, outcomes, status codes
    paths.py            where the daemon listens and keeps its cache by default, where an entry lies
    trust.py            which paths and peers are trusted (real directories of the daemon's uid,
                        SO_PEERCRED), and the safe reads of a cache file
    channel.py          how callers reach the daemon: target, TCP token, replies as dicts, status -> exception
    generate.py         regenerates the stubs (`python -m proto.generate`)
    clashes.py          whether another distribution (proto-plus, Hugging Face's kernels) installs
                        a top-level `proto` or `kernels` too: checked here, at every import

The ground floor: imports nothing from kernels/, compile_service/ or client/
(tests/test_architecture.py holds it). Light to import: no TileLang, no torch.
"""

from . import clashes  # noqa: F401  (its import fails, in one line, where a foreign `proto` or `kernels` is installed)
