"""The content store: every file of every entry, stored once by its sha256.

    blobs/<sha[:2]>/<sha>    read-only file bytes

An entry's files are hard links to their blobs, so an entry directory stays a
plain directory of regular files that a loader opens by name, while a second
key with the same bytes (a shared build's copy, the same kernel under a new
toolchain field) adds a link, not a copy. A blob no entry links any more
(link count 1) is garbage, removed by `collect`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from proto.trust import private_dir, problem

from ..fsutil import fsync_path, sha256_file


class Blobs:
    def __init__(self, root: Path, dir_mode: int):
        self.dir = Path(root) / "blobs"
        self.dir_mode = dir_mode

    def path(self, sha256: str) -> Path:
        return self.dir / sha256[:2] / sha256

    def adopt(self, file: Path, sha256: str, durable: bool = True) -> None:
        """Makes `file` (sealed: final mode, fsynced when `durable`) a link to the blob of its
        bytes: the existing blob when one is whole, else `file` itself becomes the blob."""
        blob = self.path(sha256)
        private_dir(blob.parent, self.dir_mode, "cache blob directory", "run `kernel-service verify --repair`")
        st = file.stat()
        size = st.st_size
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(blob).st_ino == st.st_ino:
                return  # already linked (a copy made by linking another entry's file)
        if self._whole(blob, sha256, size):
            tmp = file.with_name(f".{file.name}.link")
            try:
                os.link(blob, tmp)
            except FileNotFoundError:  # collected meanwhile: ours becomes the blob below
                pass
            else:
                os.replace(tmp, file)
                return
        # No blob, or a damaged one: ours takes its place, atomically.
        tmp = blob.with_name(f".{blob.name}.{os.getpid()}.{os.urandom(4).hex()}")
        os.link(file, tmp)
        os.replace(tmp, blob)
        if durable:
            fsync_path(blob.parent, directory=True)

    @staticmethod
    def _whole(blob: Path, sha256: str, size: int) -> bool:
        try:
            st = os.lstat(blob)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_uid != os.getuid():
            return False
        return sha256_file(blob) == sha256

    def _walk(self):
        """Every blob, found without following a link: blobs/ itself must be a directory of
        ours that only we may write (a link planted there is never walked, nor collected from)."""
        try:
            if problem(os.lstat(self.dir), os.geteuid()):
                return
        except FileNotFoundError:
            return
        for shard in self.dir.iterdir():
            if shard.is_dir() and not shard.is_symlink():
                for blob in shard.iterdir():
                    with contextlib.suppress(FileNotFoundError):
                        yield blob, os.lstat(blob)

    def usage(self) -> int:
        """Bytes of all blobs (each counted once, however many entries link it)."""
        return sum(st.st_size for _, st in self._walk() if stat.S_ISREG(st.st_mode))

    def collect(self) -> int:
        """Removes blobs no entry links any more; returns the bytes freed."""
        freed = 0
        for blob, st in self._walk():
            if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:
                with contextlib.suppress(FileNotFoundError):
                    blob.unlink()
                    freed += st.st_size
        return freed
