"""What the local store holds, entry by entry (`kernel-service ls`), read without the index.

Reads each entry's own record (entry.json) and directory, checks nothing and
hashes nothing: `verify` is for that. Entries that vanish or are damaged while
being read are left out.
"""

from __future__ import annotations

import contextlib
import json
import os

from proto.entry import ENTRY_META, LIBRARY

from .local import LocalStore


def list_entries(store: LocalStore) -> list[dict]:
    """One dict per entry, least recently used first: key, kind, params, target, bytes (the
    library's), last_used (the entry directory's mtime, the on-disk LRU clock), created, and
    how it was built: "compiled" with its seconds, phases and device compiler, or "copy" of
    the shared build named in `shared_build`."""
    out = []
    for key in store.keys():
        path = store.entry_path(key)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            meta = json.loads((path / ENTRY_META).read_text())
            library = path / LIBRARY
            item = {
                "key": key,
                "kind": meta["spec"]["kind"],
                "params": meta["spec"]["params"],
                "target": meta["spec"]["target"],
                "bytes": os.lstat(library).st_size,
                "last_used": os.lstat(path).st_mtime,
                "created": meta.get("created"),
                "compile_seconds": meta.get("compile_seconds"),
                "cuda_compiler": (meta.get("toolchain") or {}).get("cuda_compiler"),
            }
            shared = meta.get("shared_build")
            if shared:
                item.update(built="copy", shared_build=shared["key"])
            else:
                item.update(built="compiled", phases=meta.get("phases", {}))
            out.append(item)
    return sorted(out, key=lambda e: e["last_used"])
