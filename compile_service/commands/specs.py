"""Kernel specs as the commands read them from manifests and show them."""

from __future__ import annotations

import json


def load_manifests(paths: list[str]) -> list[dict]:
    """The distinct specs of the manifests, in order; raises ManifestError."""
    from proto import manifest

    seen, specs = set(), []
    for path in paths:
        for spec in manifest.specs(path):
            text = json.dumps(spec, sort_keys=True)
            if text not in seen:
                seen.add(text)
                specs.append(spec)
    return specs


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
