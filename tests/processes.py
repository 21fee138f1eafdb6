"""The processes below a test's daemon, read from /proc: which there are, what they run, and
whether they still live."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (the daemon forks off its main thread)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, ..."""
    below = children(pid)
    return below + [d for c in below for d in descendants(c)]


def alive(pid: int) -> bool:
    """Running, not a zombie: a zombie is dead, only its reaper's wait is missing (PID 1 in a
    container may never reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
