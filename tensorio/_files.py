"""Open files shared by the requests of one handle: one descriptor per (file, mode, O_DIRECT), refcounted.

A request holds its `OpenFile` from the moment it is started until its last piece has finished, so
10,000 requests queued on three files hold three descriptors (six with their buffered companions),
not 10,000. A file name is reused only while it still names the same inode: a file that was
replaced (renamed over, deleted and recreated) between two requests gets a descriptor of its own.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from ._errors import TensorIOError
from ._fs import fd_is_direct, open_error, open_for_io, reopen_buffered


class OpenFile:
    """One descriptor and, opened on first need, its buffered companion (for unaligned pieces)."""

    __slots__ = ("fd", "direct", "write", "buffered_fd", "_inode", "_owned", "_refs", "_table", "_key", "_lock")

    def __init__(self, table: "FileTable", key: tuple, fd: int, *, direct: bool, write: bool, owned: bool,
                 inode: tuple[int, int]) -> None:
        self.fd = fd
        self.direct = direct
        self.write = write
        self.buffered_fd: int | None = None if direct else fd
        self._inode = inode
        self._owned = owned  # False for a descriptor the caller passed in: never closed here
        self._refs = 1
        self._table = table
        self._key = key
        self._lock = threading.Lock()

    def buffered(self) -> int:
        """The buffered descriptor: ``fd`` itself without O_DIRECT, else a second one opened once."""
        with self._lock:
            if self.buffered_fd is None:
                self.buffered_fd = reopen_buffered(self.fd, write=self.write)
            return self.buffered_fd

    def release(self) -> None:
        """Drop one request's hold; the last one closes the descriptors."""
        self._table.release(self)

    def _close(self) -> None:
        if self.buffered_fd is not None and self.buffered_fd != self.fd:
            os.close(self.buffered_fd)
        if self._owned:
            os.close(self.fd)


class FileTable:
    """The files a handle has open for requests in flight."""

    def __init__(self) -> None:
        self._open: dict[tuple, OpenFile] = {}
        self._lock = threading.Lock()

    def acquire_path(self, name: str, *, write: bool, direct: bool, offset: int, length: int) -> OpenFile:
        """The shared file for ``name`` opened for a read or a write, with or without O_DIRECT.

        Raises TensorIOError naming the path (missing file or directory, a directory, permissions).
        """
        key = (name, write, direct)
        entry = self._reuse(key)
        if entry is not None:
            try:
                st = os.stat(name)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == entry._inode:
                return entry
            self.release(entry)  # the name now means another file (or none): open it afresh
        fd = open_for_io(name, write=write, direct=direct, offset=offset, length=length)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # only a read can open a directory; it must not get further
            os.close(fd)
            raise open_error(errno.EISDIR, name, write=write, offset=offset, length=length)
        return self._add(OpenFile(self, key, fd, direct=direct, write=write, owned=True,
                                  inode=(st.st_dev, st.st_ino)))

    def acquire_fd(self, fd: int, *, write: bool) -> OpenFile:
        """The shared record of a descriptor the caller opened (never closed here).

        Raises TensorIOError for a descriptor that is not open.
        """
        try:
            st = os.fstat(fd)
            direct = fd_is_direct(fd)
        except OSError as exc:
            raise TensorIOError(exc.errno or errno.EBADF, "bad file descriptor", path=f"fd {fd}", offset=0,
                                length=0) from None
        key = (f"fd {fd}", write, direct)
        entry = self._reuse(key)
        if entry is not None:
            if entry._inode == (st.st_dev, st.st_ino):
                return entry
            self.release(entry)  # the caller closed it and opened another file under the same number
        return self._add(OpenFile(self, key, fd, direct=direct, write=write, owned=False,
                                  inode=(st.st_dev, st.st_ino)))

    def release(self, entry: OpenFile) -> None:
        """Drop one hold on ``entry``; closes its descriptors when it was the last."""
        with self._lock:
            entry._refs -= 1
            if entry._refs:
                return
            if self._open.get(entry._key) is entry:
                del self._open[entry._key]
        entry._close()

    def _reuse(self, key: tuple) -> OpenFile | None:
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                entry._refs += 1
            return entry

    def _add(self, entry: OpenFile) -> OpenFile:
        with self._lock:
            self._open[entry._key] = entry  # a stale entry under this key lives on until its last release
        return entry
