"""The contract between the daemon and its clients; both import it, neither imports the other.

    kernelservice/v1/   the wire format (.proto and its generated stubs): the API reference
    wire.py             specs <-> proto, request limits, outcomes, status codes
    abi.py              the call ABI and the entry metadata a published kernel carries
    paths.py            where the daemon listens and keeps its cache by default
    channel.py          how callers reach the daemon: target, TCP token, replies as dicts, status -> exception
    trust.py            which paths and peers are trusted: real directories of the daemon's uid, SO_PEERCRED

Light to import: no TileLang, no torch.
"""
