"""Whether another distribution installs a top-level package under this project's names.

The wheel installs `client`, `compile_service`, `kernels` and `proto` as top-level packages (a
fixed layout). Two known distributions use the same names: proto-plus (`proto`, which Google's
client libraries depend on) and Hugging Face's `kernels`. In one environment pip merges both
into one directory, whichever order they come in, and one breaks the other (an uninstall of
either then removes files the other needs); in two directories on sys.path, the first hides
the other. Importing this module says so in one line (PackageClash, an ImportError), naming the
other distribution and the remedy.

Cheap enough for every import (about 0.3 ms from a source tree, 1.5 ms in a wheel install, on a
busy 2-core machine; `import client` takes about 120 ms): a few stat calls per sys.path entry,
and for a wheel install our own RECORD read and the two package directories listed. Other
distributions' metadata is read only where a package of the same name is found outside ours.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import sys
from pathlib import Path

OURS = "kernel-service"
SHARED = ("proto", "kernels")  # names other distributions install too (proto-plus, Hugging Face's kernels)
REMEDY = "install kernel-service in an environment of its own (python -m venv), or run the daemon from the sidecar image"
ROOT = Path(__file__).resolve().parents[1]  # where our four packages lie side by side


class PackageClash(ImportError):
    """Another distribution's package has one of our top-level names; the message is one line."""


@functools.cache
def check() -> None:
    """Raises PackageClash when a foreign `proto` or `kernels` is installed; once per process."""
    if problem := find_clash():
        raise PackageClash(problem)


def find_clash(root: Path = ROOT, path: list[str] | None = None) -> str | None:
    """One line naming the first clash found, else None."""
    record = _our_record(root)
    elsewhere = [p for p in dict.fromkeys(os.path.realpath(e or os.curdir) for e in (sys.path if path is None else path)) if p != str(root)]
    for name in SHARED:
        if record is not None and (merged := _merged(root, name, record)):
            return (
                f"`{name}` is a top-level package of both kernel-service and {merged}, whose files are merged in {root / name}: one breaks the other; {REMEDY}"
            )
        for where in elsewhere:
            if not (os.path.isdir(os.path.join(where, name)) or os.path.isfile(os.path.join(where, f"{name}.py"))):
                continue
            if other := _claimant(Path(where), name):  # a copy no distribution claims (a test's, a checkout's) is no clash
                return f"`{name}` is a top-level package of both kernel-service ({root / name}) and {other} ({where}/{name}): the first on sys.path hides the other; {REMEDY}"
    return None


def _our_record(root: Path) -> list[str] | None:
    """The files our wheel installed (RECORD's paths, hashes and sizes), or None where our packages
    are no wheel install (a source tree, an editable install)."""
    for info in root.glob("kernel_service-*.dist-info"):
        try:
            return (info / "RECORD").read_text().splitlines()
        except OSError:
            return None
    return None


def _merged(root: Path, name: str, record: list[str]) -> str | None:
    """The distribution whose files share our package directory `name` (files our RECORD does not
    list, or an __init__.py that is not ours), else None."""
    ours = {line.split(",")[0].split("/")[1] for line in record if line.startswith(f"{name}/")}
    try:
        foreign = set(os.listdir(root / name)) - ours - {"__pycache__"}
    except OSError:
        return None
    init = next((line.split(",") for line in record if line.startswith(f"{name}/__init__.py,")), None)
    if not foreign and init and _digest(root / name / "__init__.py") == init[1]:
        return None
    return _claimant(root, name) or f"another distribution (unknown files {sorted(foreign) or ['__init__.py']})"


def _digest(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _claimant(where: Path, name: str) -> str | None:
    """'name version' of a distribution in `where`, other than ours, that installs top-level `name`."""
    for info in sorted(where.glob("*.dist-info")):
        try:
            meta = dict(line.split(": ", 1) for line in (info / "METADATA").read_text(errors="replace").split("\n\n", 1)[0].splitlines() if ": " in line)
            if meta.get("Name", "").lower().replace("_", "-") == OURS:
                continue
            top = info / "top_level.txt"
            claimed = (
                top.read_text().split()
                if top.is_file()
                else [p.split(",")[0].split("/")[0].removesuffix(".py") for p in (info / "RECORD").read_text().splitlines()]
            )
        except OSError:
            continue
        if name in claimed:
            return f"{meta.get('Name', info.name)} {meta.get('Version', '')}".strip()
    return None


check()  # at import: proto/__init__.py imports this module, and so does client/__init__.py (where proto-plus's __init__.py replaced ours)
