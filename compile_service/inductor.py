"""The shared persistent torch.compile (Inductor) directory the daemon owns.

Inductor keeps compiled graphs under TORCHINDUCTOR_CACHE_DIR, by default under
/tmp, which a reboot or a fresh container loses. The daemon keeps one under its
cache root, so every agent on the host (and every restart) reuses them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from proto.paths import inductor_dir
from proto.trust import private_dir


def ensure(cache_root: Path) -> Path:
    """Creates the directory with the cache root's permission bits (owner-only unless configured
    shared); one that exists must be a real directory of ours (never a link: see proto/trust.py)."""
    path = inductor_dir(cache_root)
    mode = stat.S_IMODE(os.lstat(cache_root).st_mode)
    private_dir(path, mode, "Inductor cache directory", "remove it and restart the daemon")
    return path


def usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under `path`, not following symlinks."""
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size
