"""The processes below a test's daemon, read from /proc: which there are (devtools.processes),
what they run, and which carry a test's mark."""

from __future__ import annotations

import os
from pathlib import Path

from devtools.processes import alive, children, descendants

__all__ = ["alive", "carrying", "children", "cmdline", "descendants"]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def carrying(mark: bytes) -> dict[int, str]:
    """Live processes (zombies aside) whose environment holds `mark` ("NAME=value"), with their
    command lines: those a test started, their children and orphans alike (a process's
    environment is fixed at its start, so the mark shows even once it was reparented)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0") or not alive(int(entry.name)):
                continue
            found[int(entry.name)] = cmdline(int(entry.name)).strip()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found
