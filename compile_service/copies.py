"""How a missing key is made: by its own compile, or as a copy of other builds' entries, made
without compiling anything.

- A shared build: a spec that fixes dims only the host code uses (its kind's `host_side_dims`)
  is a copy of the build that leaves them to run time, its sizes recorded in the ABI for the
  loader to enforce.
- A router: a spec whose kind routes a dim over ranges is a copy of its last range's build
  (correct for every value of the dim), whose ABI names every range's build for the client to
  load and pick from per call. It waits for that one build only: the other ranges are built
  after it (Plan.after), below every request, so a cold router costs about one build.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kernels import get_kind
from kernels.spec import CanonicalSpec
from proto import abi
from proto.entry import SOURCES

from .store import Entry, StoreError


@dataclass(frozen=True)
class Plan:
    """How a missing key is made: by its own compile (no bases), or by `make(entries, staging)`
    from the entries of the builds `bases`; `after`: builds it names but does not wait for,
    made after it."""

    bases: list[CanonicalSpec] = field(default_factory=list)
    make: Callable[[list[Entry], Path], tuple[str, dict]] | None = None
    after: list[CanonicalSpec] = field(default_factory=list)


_OWN_BUILD = Plan()


def plan_of(spec: CanonicalSpec) -> Plan:
    """`spec`'s plan, from its kind: a shared build's copy, a router, or its own compile."""
    kind = get_kind(spec.kind)
    shared = kind.shared_build(spec)  # the build that serves this spec, if not its own
    if shared is not None:  # a copy of the build that leaves its host-side dims to run time
        build, fixed = shared
        return Plan([build], lambda entries, staging: _derive(entries[0], spec, fixed, staging))
    routes = kind.routes(spec)
    if routes is not None:  # a router over the builds of each range of its dim: the last serves every value
        dim, ranges = routes
        return Plan([ranges[-1][1]], lambda entries, staging: _route(entries[0], spec, dim, ranges, staging), [build for _, build in ranges[:-1]])
    return _OWN_BUILD


def _derive(base: Entry, spec: CanonicalSpec, fixed: dict, staging: Path) -> tuple[str, dict]:
    """An entry for `spec` made of `base`'s files: the same library, with the dims `spec` fixes
    recorded in the ABI for the loader to enforce. The files are hard links to `base`'s: the
    store keeps their bytes once (store.blobs)."""
    start = time.perf_counter()
    # The writable cache's files are linked (its blobs keep the bytes once); a read-only layer's
    # (store.layers) are copied: publishing chmods and links what it is given, and a layer is never written.
    share = os.link if staging.parent.parent in base.path.parents else shutil.copyfile
    try:
        for name in (base.library, *SOURCES):
            if (base.path / name).is_file():
                share(base.path / name, staging / name)
    except OSError as exc:  # a full disk, or the shared build evicted under a zero min-age budget
        raise StoreError(exc.errno, f"cannot copy the shared build {base.key[:16]} into {staging}: {exc.strerror or exc}") from exc
    meta = {
        **{k: v for k, v in base.meta.items() if k not in ("phases", "device_compiled")},
        "spec": json.loads(spec.to_json()),
        "abi": abi.with_fixed(base.abi, fixed) if fixed else base.abi,
        "shared_build": {"key": base.key, "spec": base.meta["spec"], "compile_seconds": base.meta["compile_seconds"]},
        "created": time.time(),
    }
    meta["compile_seconds"] = round(time.perf_counter() - start, 4)
    return base.library, meta


def _route(last: Entry, spec: CanonicalSpec, dim: str, ranges: list[tuple[int | None, CanonicalSpec]], staging: Path) -> tuple[str, dict]:
    """A router entry for `spec`: a copy of its last range's build `last` (correct for every value
    of `dim`), whose ABI names every range's build for the client to load and pick from per call."""
    library, meta = _derive(last, spec, {}, staging)
    meta["abi"] = abi.with_routes(meta["abi"], dim, [(upper, json.loads(build.to_json())) for upper, build in ranges])
    return library, meta
