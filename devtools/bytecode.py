"""This tree's packages byte-compiled, as an installed client's are.

A benchmark's fresh process imports client, kernels and proto from this tree; where
PYTHONDONTWRITEBYTECODE is set (this machine and CI) it would compile them from source at every
start, while torch and TileLang come with their bytecode."""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("client", "kernels", "proto", "compile_service", "devtools", "benchmark")


def compile_tree() -> None:
    """Every package's __pycache__ brought up to date (quietly; stale files only)."""
    for package in PACKAGES:
        compileall.compile_dir(ROOT / package, quiet=1)
