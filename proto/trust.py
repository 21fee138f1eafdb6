"""Whether a path is one only we (or the daemon we talk to) control, checked without following links.

Another local user must not be able to put anything where the daemon or a client
looks: a directory they own or may write lets them rename what is in it and
plant their own (a cache entry with their library, a socket with their server,
a symlink that turns a chmod or a delete onto someone else's file). So every
directory the daemon creates or reuses must be a real directory (lstat, not a
link), owned by the daemon's uid and not writable by group or others, and
every file it opens there is opened with O_NOFOLLOW and checked on its
descriptor. Part of the contract: the daemon keeps to these rules, and the
client trusts only what keeps to them. Light to import.

The safe reads are here too: a file of the cache is read through one descriptor
opened without following a link, checked on that descriptor, and bounded, so the
bytes checked are the bytes used.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pwd
import socket
import stat
import struct
from pathlib import Path

from .errors import EntryRefused


class UntrustedPath(OSError):
    """A path another user controls, or could: refused, with what to do about it."""


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def problem(st: os.stat_result, uid: int, kind: int = stat.S_IFDIR) -> str | None:
    """Why an lstat result is not a trusted `kind` owned by `uid`, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_IFMT(st.st_mode) != kind:
        return "is not a directory" if kind == stat.S_IFDIR else "is not a regular file"
    if st.st_uid != uid:
        return f"is owned by {_who(st.st_uid)}, not by {_who(uid)}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def not_yours(st: os.stat_result, uid: int) -> str | None:
    """Why a file or directory (its stat) may hold what another user than `uid` or root chose,
    or None: it must be owned by one of them and writable by neither group nor others. A
    directory like /tmp (sticky, and still root's or `uid`'s) lets others add names to it, but
    not rename or remove one of `uid`'s: it passes."""
    if st.st_uid not in (uid, 0):
        return f"is owned by {_who(st.st_uid)}, neither you (uid {uid}) nor root"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def not_yours_on_the_way(path: Path | str, uid: int) -> str | None:
    """Why another user than `uid` or root could change what `path` holds, as "<path> <why>",
    or None: the file and every directory on the way to it (as given and once links are
    resolved) must pass not_yours, since whoever may write a directory may rename what is in it
    and put their own in its place."""
    given, real = Path(os.path.abspath(path)), Path(os.path.realpath(path))
    for place in dict.fromkeys([*reversed(given.parents), given, *reversed(real.parents), real]):
        why = not_yours(os.stat(place), uid)
        if why:
            return f"{place} {why}"
    return None


class NotRegularFile(ValueError):
    """A path a command was told to read that is no regular file: a device, a fifo, a directory."""


_FILE_TYPES = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
}


def _regular(st: os.stat_result, path: Path | str, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _FILE_TYPES.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise NotRegularFile(f"{what} {path} is {kind}, not a regular file; refusing to read it")


def open_regular(path: Path | str, what: str, flags: int = 0) -> int:
    """A read descriptor on `path`, only if it is a regular file: the one rule for every file a
    command is told to read (a manifest, a bundle, a key, a token), so that /dev/zero, a fifo or
    a directory is refused in one line instead of read forever or waited on. A device is refused
    before it is opened (opening one may do something); the descriptor is checked again, opened
    without blocking, in case a fifo took the file's place meanwhile. `flags`: more open flags
    (O_NOFOLLOW). Raises NotRegularFile, or OSError when the path cannot be opened."""
    _regular(os.stat(path, follow_symlinks=not flags & os.O_NOFOLLOW), path, what)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    try:
        _regular(os.fstat(fd), path, what)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_dir(path: Path | str, uid: int, what: str, fix: str) -> os.stat_result:
    """lstat `path`: a real directory owned by `uid`, not writable by group or others; else UntrustedPath."""
    st = os.lstat(path)
    why = problem(st, uid)
    if why:
        raise UntrustedPath(errno.EPERM, f"{what} {path} {why}: another user could replace what it holds; {fix}")
    return st


def layer_owner(path: Path | str, uid: int, fix: str) -> int:
    """The uid a read-only cache layer at `path` belongs to: root or `uid` (the daemon's), whichever
    owns its root directory, which must be a real directory no one else may write; else
    UntrustedPath. Every directory and file of the layer must then be that uid's, as every one
    of the cache root's must be the daemon's: root owns a layer baked into an image."""
    st = os.lstat(path)
    return check_dir(path, st.st_uid if st.st_uid in (0, uid) else uid, "cache layer", fix).st_uid


def private_dir(path: Path | str, mode: int, what: str, fix: str, chmod: bool = True) -> None:
    """Creates `path` with `mode`, or reuses it if it is a real directory of ours that no one
    else may write, and then (when `chmod`) gives it exactly `mode`; else UntrustedPath.

    The mode is set on a descriptor opened with O_NOFOLLOW, so a link swapped in after the
    check can never turn the chmod onto another file.
    """
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            check_dir(path, os.geteuid(), what, fix)  # says why: a link, not a directory, someone else's
        raise
    try:
        st = os.fstat(fd)
        why = problem(st, os.geteuid())
        if why:
            raise UntrustedPath(errno.EPERM, f"{what} {path} {why}: another user could replace what it holds; {fix}")
        if chmod and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # mkdir's mode went through the umask, or the directory predates us
    finally:
        os.close(fd)


def open_private_file(path: Path | str, flags: int, mode: int = 0o600) -> int:
    """A descriptor on `path` (created with `mode` if missing), never through a link, and only if
    it is a regular file of ours with one name; its mode is then exactly `mode`. Raises
    UntrustedPath otherwise."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPath(errno.ELOOP, f"{path} is a symbolic link; refusing to open it (remove it)") from None
        raise
    try:
        st = os.fstat(fd)
        why = problem(st, os.geteuid(), stat.S_IFREG) or (f"has {st.st_nlink} names (hard links)" if st.st_nlink != 1 else None)
        if why:
            raise UntrustedPath(errno.EPERM, f"{path} {why}; refusing to use it (remove it)")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


MAX_RECORD = 1 << 20  # bytes of a record read whole (manifest.json, entry.json): far above any real one


def read_owned(path: Path | str, owner: int, size: int | None = None, limit: int = MAX_RECORD) -> bytes:
    """A file's bytes, read through one descriptor opened without following a link, after
    checking on that descriptor that it is a regular file of `owner` that no one else may
    write, and has `size` bytes when given, else at most `limit`. Raises EntryRefused, or
    FileNotFoundError when there is no such file (gone: not a refusal)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise EntryRefused(f"cannot open {path}: {exc.strerror} (symlinks are refused)") from None
    try:
        st = os.fstat(fd)
        why = problem(st, owner, stat.S_IFREG)
        if why:
            raise EntryRefused(f"{path} {why}")
        if size is not None and st.st_size != size:
            raise EntryRefused(f"{path} has {st.st_size} bytes, expected {size}")
        if size is None and st.st_size > limit:
            raise EntryRefused(f"{path} has {st.st_size} bytes, more than {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(size if size is not None else limit + 1)
    finally:
        os.close(fd)
    if (len(data) != size) if size is not None else (len(data) > limit):
        raise EntryRefused(f"{path} changed size while it was read")
    return data


def read_verified(path: Path | str, sha256: str, size: int, *, owner: int) -> bytes:
    """The file's bytes (read_owned: a regular file of `owner` of `size` bytes), once they
    match `sha256`; raises EntryRefused (FileNotFoundError when it is gone)."""
    data = read_owned(path, owner, size)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise EntryRefused(f"{path} does not match its published sha256")
    return data


def peer_uid(path: Path | str, timeout: float = 5.0) -> int:
    """The uid of the process listening on the Unix socket `path` (SO_PEERCRED), which the
    kernel records when that process called listen(): it cannot be faked by the server.
    Raises OSError when nothing listens there (ENOENT, ECONNREFUSED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid
