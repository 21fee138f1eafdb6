"""How the commands print: a failure in one line, sizes, times, progress."""

from __future__ import annotations

import sys
import time


def fail(message: str, status: int = 1) -> int:
    """Says `message` on stderr as the one line of a failure; returns the exit status."""
    print(f"kernel-service: {message}", file=sys.stderr)
    return status


def os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror or str(exc)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def progress(total: int):
    """`step(line)` per finished kernel: a tqdm bar when tqdm is installed and the output is a
    terminal, else one plain line each."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(total=total, unit="kernel", file=sys.stderr)

        def step(line: str) -> None:
            bar.update(1)
            bar.set_postfix_str(line[:60])

        return step
    done = 0

    def step(line: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done:>{len(str(total))}}/{total}] {line}", flush=True)

    return step
