"""Opening files inside a store directory that someone else may have tampered with.

The store never follows a symbolic link inside its directory and only ever opens regular
files: a link named `journal.log` must not make the writer truncate a file elsewhere, and a
FIFO named like a segment must not hang a reader. Every open goes through here: O_NOFOLLOW
(a link fails with ELOOP), O_NONBLOCK (opening a FIFO returns at once; cleared again for a
regular file), then fstat on the open descriptor (no window between the check and the use).
"""
from __future__ import annotations

import errno
import os
import stat

from ..errors import StoreError

__all__ = ["NotRegularFileError", "open_regular", "create_exclusive", "unlink_if_present", "kind_of",
           "fsync_dir"]


class NotRegularFileError(StoreError):
    """A name inside the store that is a symbolic link, FIFO, directory or device."""


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path, what: str) -> NotRegularFileError:
    return NotRegularFileError(errno.EINVAL, f"{path} is {what}, not a regular file: the store opens "
                               f"only regular files and never follows links inside its directory; "
                               f"remove it", str(path))


def _check_fd(fd: int, path) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, kind_of(st.st_mode))
    fl = os.get_blocking(fd)
    if not fl:
        os.set_blocking(fd, True)
    return fd


def open_regular(path, flags: int, mode: int = 0o644) -> int:
    """os.open that refuses links and anything but a regular file (NotRegularFileError).
    FileNotFoundError passes through."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a directory opened for writing; a FIFO with no reader
            try:
                what = kind_of(os.lstat(path).st_mode)
            except OSError:
                what = "not a regular file"
            raise _refuse(path, what) from None
        raise
    return _check_fd(fd, path)


def create_exclusive(path, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Creates `path` fresh (a temporary file): whatever has that name is unlinked first (a
    link is removed, not followed), then O_CREAT | O_EXCL | O_NOFOLLOW."""
    unlink_if_present(path)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def unlink_if_present(path) -> None:
    """Removes a name (a link itself, never its target); a directory is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "a directory")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
