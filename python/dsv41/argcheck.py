"""Checks of what a user hands a `dsv41` command, shared by every command's parser: numbers
within a range (argparse types, so a bad value is argparse's one-line error and exit
status 2), and files read whole that must be regular files of a bounded size (a FIFO or
/dev/zero would block or never end). The standard library only: any layer may use it.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import stat

__all__ = ["IntRange", "FloatRange", "device", "output_dir", "read_regular_file", "check_regular_file"]

_DEVICE = re.compile(r"^(cpu|cuda(:\d{1,4})?)$")


class IntRange:
    """An argparse type: a base-10 integer in [lo, hi] (hi None: no upper bound)."""

    def __init__(self, lo: int, hi: int | None = None):
        self.lo, self.hi = lo, hi
        self.__name__ = "integer"   # argparse names the type in its "invalid ..." errors

    def __call__(self, text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < self.lo or (self.hi is not None and value > self.hi):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value

    def describe(self) -> str:
        return f"at least {self.lo}" if self.hi is None else f"an integer in [{self.lo}, {self.hi}]"


class FloatRange:
    """An argparse type: a finite number in [lo, hi] (above lo when lo_open)."""

    def __init__(self, lo: float, hi: float, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open
        self.__name__ = "number"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not math.isfinite(value) or not low_ok or value > self.hi:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value

    def describe(self) -> str:
        return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


def device(text: str) -> str:
    """An argparse type: a torch device a command may run on: cpu, cuda or cuda:N."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory a command writes into, existing or to be created: not
    a file, device or FIFO, and not below one (the nearest existing ancestor is a directory)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got an empty path")
    p = os.path.abspath(text)
    while True:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            parent = os.path.dirname(p)
            if parent == p:
                raise argparse.ArgumentTypeError(f"{text}: no existing directory above it") from None
            p = parent
            continue
        except NotADirectoryError:
            raise argparse.ArgumentTypeError(f"{text}: a component of the path is a file") from None
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{text}: {e.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            what = "a file" if stat.S_ISREG(st.st_mode) else "a device, FIFO or socket"
            where = "" if p == os.path.abspath(text) else f" ({p} is {what})"
            raise argparse.ArgumentTypeError(f"{text} is not a directory{where}" if where else
                                             f"{text} is {what}, not a directory")
        return text


def check_regular_file(path: str | os.PathLike, max_bytes: int) -> None:
    """Raises ValueError unless path is a regular file (links followed) of at most max_bytes;
    OSError when it cannot be looked at (missing, permissions). Opens nothing."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise ValueError(f"{os.fspath(path)} is {kind}")
    if st.st_size > max_bytes:
        raise ValueError(f"{os.fspath(path)} is {st.st_size:,} bytes, more than the {max_bytes:,} allowed")


def read_regular_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most max_bytes. ValueError for anything else (a
    directory, a FIFO or device, which are never opened for reading in a way that blocks,
    a file that is or grows too large); OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
            raise ValueError(f"{os.fspath(path)} is {kind}")
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"{os.fspath(path)} is more than the {max_bytes:,} bytes allowed")
        return b"".join(chunks)
    finally:
        os.close(fd)
