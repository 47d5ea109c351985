"""SegmentFds: the open files of a store's segments, for reading.

A segment's read descriptor (O_DIRECT where the filesystem takes it) and, for reads into
device memory, its cuFile handle, are opened on first use and kept until the segment is
retired (GC, or a reader's refresh). A read in flight may still use a retired segment's
descriptor: retiring then parks the descriptor until the last read ends.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading

from ..io import IOEngine
from ..io import GdsFile
from .index import SegmentFile
from .state import StoreState

__all__ = ["SegmentFds"]


class SegmentFds:
    def __init__(self, state: StoreState, engine: IOEngine):
        self._state = state
        self._engine = engine
        self._lock = threading.Lock()  # the read count and the parked fds
        self._active_reads = 0
        self._parked: list[int] = []   # fds of retired segments, closed when no read is in flight
        self._gds: dict[bytes, object] = {}  # segment uuid -> GdsFile
        self.direct_seen: bool | None = None  # whether the filesystem took O_DIRECT

    def fd(self, seg: SegmentFile) -> int:
        """The segment's read descriptor, opened on first use (call under the state lock).
        Raises FileNotFoundError when the file is gone or is no longer a regular file,
        another OSError when it cannot be opened (EMFILE, EACCES, a link in its place)."""
        if seg.fd is None:
            path = self._state.path / seg.name
            f = self._engine.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, direct=self._state.direct)
            if not stat.S_ISREG(os.fstat(f.fd).st_mode):  # replaced since it was indexed
                os.close(f.fd)
                raise FileNotFoundError(errno.ENOENT, f"{path} is no longer a regular file")
            os.set_blocking(f.fd, True)
            seg.fd, seg.direct = f.fd, f.direct
            self.direct_seen = f.direct
        return seg.fd

    def gds_file(self, seg: SegmentFile):
        """The segment's cuFile handle (GdsFile), registered on first use; raises
        RuntimeError (cuFile's reason) or OSError. Reads in flight hold their own reference."""
        with self._state.lock:
            f = self._gds.get(seg.uuid)
            if f is None:
                path = self._state.path / seg.name
                if not path.is_file() or path.is_symlink():
                    raise FileNotFoundError(errno.ENOENT, f"{path} is not a regular file")
                f = self._gds[seg.uuid] = GdsFile(str(path), False)
            return f

    @contextlib.contextmanager
    def reading(self):
        """Marks a read in flight, so descriptors that GC retires stay open until it ends."""
        self.begin_read()
        try:
            yield
        finally:
            self.end_read()

    def begin_read(self) -> None:
        with self._lock:
            self._active_reads += 1

    def end_read(self) -> None:
        with self._lock:
            self._active_reads -= 1
            if self._active_reads == 0:
                for fd in self._parked:
                    os.close(fd)
                self._parked.clear()

    def retire(self, segs: list[SegmentFile], unlink: bool = True) -> None:
        """Forgets segments (GC compacted or emptied them; a reader saw them go): their
        descriptors close (after the reads in flight), and a writer deletes the files."""
        state = self._state
        for s in segs:
            with state.lock:
                state.segments.pop(s.uuid, None)
                self._gds.pop(s.uuid, None)
                if s.fd is not None:
                    with self._lock:
                        if self._active_reads:
                            self._parked.append(s.fd)
                        else:
                            os.close(s.fd)
                    s.fd = None
            if unlink and state.mode == "w":
                try:
                    os.unlink(state.path / s.name)
                except FileNotFoundError:
                    pass

    def close_all(self) -> None:
        """Closes every descriptor (the store is closing: no read is in flight)."""
        with self._state.lock:
            for s in self._state.segments.values():
                if s.fd is not None:
                    os.close(s.fd)
                    s.fd = None
            with self._lock:
                for fd in self._parked:
                    os.close(fd)
                self._parked.clear()
            self._gds.clear()
