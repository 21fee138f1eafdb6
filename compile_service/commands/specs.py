"""Kernel specs as the commands read them from manifests and show them."""

from __future__ import annotations

import json


def load_manifests(paths: list[str]) -> list[dict]:
    """The distinct specs of the manifests, in order; raises ManifestError."""
    from proto import manifest

    return distinct([spec for path in paths for spec in manifest.specs(path)])


def with_routes(specs: list[dict]) -> list[dict]:
    """`specs` and, after each router of a kind this process knows, the builds it routes to:
    the daemon publishes a router once its last range's build is, and builds the others after
    it, so a prewarm that waits for the router alone would not wait for them."""
    import kernels

    out = []
    for spec in specs:
        out.append(spec)
        try:
            canonical = kernels.canonicalize(spec["kind"], params_of(spec), spec["target"])
        except (ValueError, KeyError):  # InvalidSpec: a kind only the daemon knows, or a spec it refuses with a reason
            continue
        routes = kernels.get_kind(canonical.kind).routes(canonical)
        for _, build in routes[1] if routes else ():
            wire = json.loads(build.to_json())
            out.append({"kind": wire["kind"], "target": wire["target"], **wire["params"]})
    return distinct(out)


def distinct(specs: list[dict]) -> list[dict]:
    """The distinct specs, in order."""
    seen, out = set(), []
    for spec in specs:
        text = json.dumps(spec, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append(spec)
    return out


def params_of(spec: dict) -> dict:
    """A manifest spec's parameters: all but its kind and target."""
    return {k: v for k, v in spec.items() if k not in ("kind", "target")}


def show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def label(spec: dict) -> str:
    params = " ".join(f"{k}={show(v)}" for k, v in params_of(spec).items())
    return f"{spec['kind']} {params} on {spec['target']}"


def summary(built: list, present: list, failed: list, total: int, where: str = "") -> int:
    """Prewarm's last lines, with or without a daemon; exit 1 if any kernel failed."""
    print(f"built {len(built)}, already there {len(present)}, failed {len(failed)} (of {total} kernels){where}")
    for spec, reason in failed:
        print(f"failed: {label(spec)}: {reason.splitlines()[0] if reason else ''}")
    return 1 if failed else 0
