"""Which process `kernel-service stop --socket PATH` may signal: only the daemon serving PATH.

The pid comes from a file next to the socket, in a directory that may be another user's: a
pid read there is a claim, not a fact. So everything is read without following links, in a
socket directory that no one but its owner may write (the daemon's uid is that owner), and
the process named must be that daemon: running as the directory's owner, started as
`kernel-service serve` or `python -m compile_service.cli serve` (the console script, the
module, and devtools/launch.py, which runs the module) for this very socket. The signal goes
through a pidfd opened before those checks, so a pid reused meanwhile is never signalled.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import stat
from pathlib import Path

from proto.errors import EntryRefused
from proto.paths import SOCKET_ENV, default_socket
from proto.trust import problem, read_owned

from .config import SETTINGS
from .server import socket_lock  # the daemon's instance lock for a socket, its pid file next to it

CLI_MODULE = "compile_service.cli"
CONSOLE_SCRIPT = "kernel-service"
BEFORE_COMMAND = {s.flag for s in SETTINGS.values() if s.before_command}  # flags that may come before `serve`


class NotTheDaemon(Exception):
    """The pid file, or the process it names, fails a check: nothing is signalled."""


def _socket_dir_owner(socket: Path) -> int | None:
    """The uid owning the socket's directory (the daemon's), None if there is no directory;
    NotTheDaemon when others could write in it (then anyone could have written the pid)."""
    try:
        st = os.lstat(socket.parent)
    except FileNotFoundError:
        return None
    why = problem(st, st.st_uid)
    if why:
        raise NotTheDaemon(f"the socket directory {socket.parent} {why}: anyone could have written the pid file there")
    return st.st_uid


def lock_held(socket: Path, owner: int) -> bool:
    """Whether a process holds the instance lock of `socket` (a file of `owner`, never a link)."""
    lock = socket_lock(socket)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise NotTheDaemon(f"cannot open {lock}: {exc.strerror} (symlinks are refused)") from None
    try:
        why = problem(os.fstat(fd), owner, stat.S_IFREG)
        if why:
            raise NotTheDaemon(f"{lock} {why}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False  # taken by us: no daemon (closing the descriptor lets it go)
    finally:
        os.close(fd)


def _proc_uids(pid: int) -> tuple[int, int]:
    """(real, effective) uid of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            real, effective = line.split()[1:3]
            return int(real), int(effective)
    raise NotTheDaemon(f"/proc/{pid}/status names no uid")


def _serve_args(argv: list[str]) -> list[str] | None:
    """The arguments after `serve` when `argv` starts the daemon (`kernel-service [--log-level L]
    [--log-format F] serve ...`, or an interpreter running the console script or `-m compile_service.cli`), else None."""
    rest = None
    for i, token in enumerate(argv):
        if os.path.basename(token) == CONSOLE_SCRIPT:
            rest = argv[i + 1 :]
        elif token == "-m" and argv[i + 1 : i + 2] == [CLI_MODULE]:
            rest = argv[i + 2 :]
        elif token == f"-m{CLI_MODULE}":
            rest = argv[i + 1 :]
        elif (i == 0 and os.path.basename(token).startswith("python")) or (i > 0 and token.startswith("-") and token != "-c"):
            continue  # the interpreter, and its own flags
        break
    if rest is None:
        return None
    while rest[:1] and rest[0].split("=", 1)[0] in BEFORE_COMMAND:  # --log-level L, --log-format=json
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    return rest[1:] if rest[:1] == ["serve"] else None


def _served_socket(args: list[str], pid: int, uid: int) -> Path:
    """The socket a daemon started with `serve ARGS` listens on, as `serve` resolves it (its flag,
    else its $KERNEL_SERVICE_SOCKET, else the default for its uid), a relative path taken from its
    working directory. Reads /proc/PID/environ and cwd only when needed (another user's are closed)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--socket")  # an abbreviation `serve` took for --socket is one here too
    try:
        given = parser.parse_known_args(args)[0].socket
    except argparse.ArgumentError as exc:
        raise NotTheDaemon(f"cannot tell which socket process {pid} serves ({exc})") from None
    if given:
        path = Path(given)
    else:
        environ = dict(item.decode(errors="replace").partition("=")[::2] for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
        path = Path(environ[SOCKET_ENV]) if environ.get(SOCKET_ENV) else default_socket(environ, uid)
    return Path(os.path.normpath(path if path.is_absolute() else Path(os.readlink(f"/proc/{pid}/cwd")) / path))


def _same_socket(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:  # the same directory reached by another path (a link, a bind mount)
        return a.name == b.name and os.path.samestat(os.stat(a.parent), os.stat(b.parent))
    except OSError:
        return False


def check_process(pid: int, socket: Path, owner: int) -> None:
    """Raises NotTheDaemon unless process `pid` runs as `owner` and is a daemon serving `socket`
    (ProcessLookupError when there is no such process)."""
    try:
        real, effective = _proc_uids(pid)
        if (real, effective) != (owner, owner):
            raise NotTheDaemon(f"process {pid} runs as uid {effective}, but the socket directory is uid {owner}'s, as its daemon's is")
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
        args = _serve_args(argv)
        if args is None:
            raise NotTheDaemon(f"process {pid} is not a kernel-service daemon (its command line: {' '.join(argv)[:200]!r})")
        served = _served_socket(args, pid, owner)
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except (OSError, ValueError) as exc:
        raise NotTheDaemon(f"cannot read what process {pid} is ({exc})") from None
    if not _same_socket(served, Path(os.path.abspath(socket))):
        raise NotTheDaemon(f"process {pid} is a kernel-service daemon serving {served}, not {socket}")


def _verified(socket: Path) -> tuple[int, int] | None:
    """(pid, uid) of the daemon serving `socket`, verified (check_process); None when no process
    holds its instance lock. Raises NotTheDaemon when the pid file or the process fails a check."""
    owner = _socket_dir_owner(socket)
    if owner is None or not lock_held(socket, owner):
        return None
    pid_file = socket_lock(socket).with_suffix(".pid")
    try:
        text = read_owned(pid_file, owner, limit=32).decode(errors="replace").strip()
    except FileNotFoundError:
        raise NotTheDaemon(f"a process holds {socket_lock(socket)} but there is no {pid_file}") from None
    except EntryRefused as exc:
        raise NotTheDaemon(str(exc)) from None
    if not text.isdigit() or int(text) < 2:
        raise NotTheDaemon(f"{pid_file} holds no pid ({text[:32]!r})")
    pid = int(text)
    try:
        check_process(pid, socket, owner)
    except ProcessLookupError:
        raise NotTheDaemon(f"{pid_file} names pid {pid}, which does not exist, yet a process holds {socket_lock(socket)}") from None
    return pid, owner


def running_daemon(socket: Path) -> int | None:
    """The pid of the daemon serving `socket`, verified; None when none runs there. Raises NotTheDaemon."""
    found = _verified(socket)
    return found[0] if found else None


def terminate(socket: Path) -> int | None:
    """Sends SIGTERM to the daemon serving `socket` once it is verified; its pid, or None when no
    daemon runs there (or it exited meanwhile). Raises NotTheDaemon (nothing sent), PermissionError."""
    found = _verified(socket)
    if found is None:
        return None
    pid, owner = found
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        try:  # checked again, now that the handle pins the process: a pid reused before pidfd_open is caught here
            check_process(pid, socket, owner)
            signal.pidfd_send_signal(handle, signal.SIGTERM)  # the daemon drains: in-flight compiles get its --grace seconds
        except ProcessLookupError:
            return None
    finally:
        os.close(handle)
    return pid
