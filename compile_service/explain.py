"""Why a spec hits or misses: the inputs of its key, and the nearest entries with what differs.

A key is sha256(canonical spec + toolchain fingerprint) (keys.py), so a miss
next to a near-identical entry is always one of: another parameter value
(`N=4096 vs 4104`), another target, or another toolchain part (`tilelang
0.1.15 vs 0.1.16`, `cuda nvrtc-13.0 vs nvcc-13.0.88`). Every entry records its
spec and toolchain in entry.json; the nearest are those of the same kind that
differ in the fewest fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from kernels.spec import CanonicalSpec

from .store import LocalStore

NEAREST = 5
LABELS = {"cuda_compiler": "cuda"}  # how a toolchain part reads in a difference


@dataclass(frozen=True)
class Difference:
    part: str  # "param", "target" or "toolchain"
    field: str
    wanted: object  # the value asked for; MISSING when the spec has no such field
    found: object  # the entry's

    @property
    def text(self) -> str:
        if self.part == "param":
            return f"{self.field}={show(self.wanted)} vs {show(self.found)}"
        return f"{LABELS.get(self.field, self.field)} {show(self.wanted)} vs {show(self.found)}"


@dataclass(frozen=True)
class Near:
    key: str
    spec: dict
    differences: tuple[Difference, ...]


@dataclass(frozen=True)
class Explanation:
    hit: bool
    key: str
    spec: dict  # the canonical spec asked for
    toolchain: dict  # the fingerprint part by part
    nearest: tuple[Near, ...] = field(default=())
    reason: str = "hit"


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()


def show(value) -> str:
    """A value as people write it: strings bare, the rest as JSON (None as null)."""
    if value is MISSING:
        return "(absent)"
    return value if isinstance(value, str) else json.dumps(value)


def differences(spec: dict, toolchain: dict, other_spec: dict, other_toolchain: dict) -> tuple[Difference, ...]:
    """Every field in which an entry (`other_*`) differs from what is asked for: parameters
    in name order, then the target, then the toolchain parts."""
    out = []
    params, other = spec.get("params", {}), other_spec.get("params") or {}
    for name in sorted(set(params) | set(other)):
        wanted, found = params.get(name, MISSING), other.get(name, MISSING)
        if wanted != found or type(wanted) is not type(found):  # 1 and 1.0 are other kernels
            out.append(Difference("param", name, wanted, found))
    if spec.get("target") != other_spec.get("target"):
        out.append(Difference("target", "target", spec.get("target"), other_spec.get("target")))
    for name in sorted(set(toolchain) | set(other_toolchain)):
        wanted, found = toolchain.get(name, MISSING), other_toolchain.get(name, MISSING)
        if wanted != found:
            out.append(Difference("toolchain", name, wanted, found))
    return tuple(out)


def explain(store: LocalStore, spec: CanonicalSpec, key: str, toolchain: dict, records: Iterable[tuple[str, dict]] | None = None) -> Explanation:
    """Hit or miss for `spec` (whose key is `key`, made with `toolchain`), and for a miss the
    nearest entries. `records`: the store's (key, entry.json) pairs, when the caller already
    read them (one Prefetch explaining many misses)."""
    wanted = json.loads(spec.to_json())
    if store.lookup(key, wanted) is not None:
        return Explanation(True, key, wanted, toolchain, reason="hit")
    near, others = [], 0
    for other_key, meta in store.records() if records is None else records:
        other_spec = meta.get("spec")
        if not isinstance(other_spec, dict) or other_spec.get("kind") != spec.kind:
            others += 1
            continue
        toolchain_found = meta.get("toolchain") if isinstance(meta.get("toolchain"), dict) else {}
        near.append(Near(other_key, other_spec, differences(wanted, toolchain, other_spec, toolchain_found)))
    near.sort(key=lambda n: (len(n.differences), n.key))
    nearest = tuple(near[:NEAREST])
    return Explanation(False, key, wanted, toolchain, nearest, _reason(spec.kind, nearest, len(near), others))


def _reason(kind: str, nearest: tuple[Near, ...], same_kind: int, others: int) -> str:
    if not nearest:
        return f"no entry of kind {kind} in the cache ({others} entries of other kinds)"
    best = nearest[0]
    if not best.differences:
        return f"entry {best.key} records the same spec and toolchain under another key: it was keyed by another kernel-service version"
    return f"the nearest of {same_kind} {kind} entries ({best.key[:16]}) differs in {', '.join(d.text for d in best.differences)}"
