"""The one exception type tensorio raises for failed I/O."""

from __future__ import annotations

import errno as errno_module
import os


class TensorIOError(OSError):
    """A read or write that did not complete: names the path, the file offset and the length.

    ``errno`` is the system error (ENOSPC, EIO, ENOENT, ...) or EIO for a short transfer;
    ``path``, ``offset`` and ``length`` say which byte range of which file failed.
    """

    def __init__(self, err: int, what: str, *, path: str, offset: int, length: int, hint: str = "",
                 name_errno: bool = True) -> None:
        self.path = path
        self.offset = offset
        self.length = length
        message = f"{what}: {path} at offset {offset}, length {length}"
        if err and name_errno:
            message += f" ({errno_module.errorcode.get(err, err)}: {os.strerror(err)})"
        if hint:
            message += f"; {hint}"
        super().__init__(err, message)
        self.filename = path

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (_rebuild, (self.errno, self.strerror, self.path, self.offset, self.length))


def _rebuild(err: int, message: str, path: str, offset: int, length: int) -> "TensorIOError":
    exc = TensorIOError.__new__(TensorIOError)
    OSError.__init__(exc, err, message)
    exc.path, exc.offset, exc.length, exc.filename = path, offset, length, path
    return exc


_HINTS = {
    errno_module.ENOSPC: "the disk is full: free space or point the swap directory elsewhere",
    errno_module.EDQUOT: "the disk quota is exhausted: free space or point the swap directory elsewhere",
    errno_module.EACCES: "check the permissions of the file and its directory",
    errno_module.EPERM: "check the permissions of the file and its directory",
    errno_module.ENOENT: "the file or its directory does not exist",
    errno_module.EROFS: "the file system is read-only",
    errno_module.EIO: "the device reported an I/O error",
    errno_module.EINVAL: "the file system refused the request (alignment or O_DIRECT); try direct=False",
}


def io_error(err: int, op: str, *, path: str, offset: int, length: int) -> TensorIOError:
    """Build the TensorIOError for a system error ``err`` during ``op`` ("read" or "write")."""
    return TensorIOError(err, f"{op} failed", path=path, offset=offset, length=length, hint=_HINTS.get(err, ""))
