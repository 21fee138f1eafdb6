"""Small file and process primitives the store and the workers share."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems refuse directory fsync; data fsync must work
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str, mode: int | None = None, fsync: bool = True) -> None:
    """Temp file in the same directory (0600, or `mode`), fsync (unless told not to), os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: dict, fsync: bool = True) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True), fsync=fsync)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Has the kernel SIGKILL this process when its parent dies (Linux), and exits now if the
    parent is already gone: a compile worker must never outlive a killed daemon.

    The signal follows the parent *thread* that spawned this process, so spawn from a thread
    that lives as long as the parent (the daemon's main thread does).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing ties us to the parent
        return
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def remove_tree(path: Path) -> None:
    """Deletes a directory tree, or a link or file as itself: never what a link points to
    (shutil.rmtree opens every level with O_NOFOLLOW)."""
    if real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
