"""What the daemon keeps under its cache root beside the store's entries and blobs, all of it
counted in the cache's usage and budget: by the daemon, the embedded service and the CLI alike."""

from __future__ import annotations

from pathlib import Path

from .apps import APPS
from .build.compiler import DEVICE_BINARIES


def counted_dirs(root: Path) -> tuple[Path, ...]:
    """The directories under `root` whose files count toward the cache's bytes (LocalStore's extra_usage)."""
    return (root / DEVICE_BINARIES, root / APPS)
