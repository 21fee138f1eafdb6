"""The processes below a daemon, read from /proc: which there are, and whether they still live."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (the daemon forks off its main thread)."""
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:  # gone meanwhile
        return []


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
