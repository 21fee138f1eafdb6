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
import subprocess
import tempfile
import threading
from collections.abc import Callable
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


def lead_process_group() -> None:
    """Makes this process the leader of a process group of its own (in a session of its own, so
    no terminal stops or interrupts it), which every subprocess it starts joins (nvcc, g++ and
    theirs), and starts a guard that kills that group once this process is gone, however it
    died: its compilers must not outlive it. The guard is a shell blocked reading a pipe whose
    write end only this process holds (pipes are close-on-exec), so the read ends when this
    process does. Linux and other POSIX systems."""
    os.setsid()
    read_end, write_end = os.pipe()
    guard = subprocess.Popen(
        ["/bin/sh", "-c", 'read _; kill -s KILL -- "-$1"', "process-group-guard", str(os.getpid())],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read_end)
    _group_guard.update(process=guard, write_end=write_end)  # both kept for as long as this process lives


_group_guard: dict = {}


def at_idle_priority(work: Callable[[], object]) -> object:
    """Runs `work` on a thread of its own that Linux schedules only when no other thread wants a
    CPU (SCHED_IDLE: a policy is per thread, and an unprivileged thread may not leave it, so the
    caller's thread keeps its own). Returns what `work` returned, raises what it raised."""
    outcome: list = []

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux: normal priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="idle-priority")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def kill_process_group(pid: int) -> None:
    """SIGKILL to the process group `pid` leads (lead_process_group), else to `pid` alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not a group leader (yet): the process alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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
