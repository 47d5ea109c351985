"""The I/O engine's background writes (submit_write / wait_write) and seal_file, the one
call that makes a segment durable and visible: a failed write stops it before the rename,
and failures are not carried over to the next file; seal_files, a commit's segments as one
group: every flush after every write, files published in order up to the first failure.
Large staging buffers start on a huge-page boundary."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dsv41.cache import io as cio

CH = 64 << 10


@pytest.fixture
def eng():
    return cio.IOEngine(threads=2, write_depth=2)


def _chunks(n: int, seed: int = 0):
    """n staging buffers of CH random bytes, kept alive by the caller until waited for."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf, view = cio.staging(CH)
        view[:] = rng.integers(0, 256, CH, dtype=np.uint8)
        out.append((buf, view))
    return out


def _write_file(eng, path, chunks) -> tuple[cio.OpenFile, list[int]]:
    f = eng.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    tickets = [eng.submit_write(f.fd, i * CH, buf, 0, CH) for i, (buf, _) in enumerate(chunks)]
    return f, tickets


def test_queued_writes_land_in_order_and_are_waited_for_once(tmp_path, eng):
    chunks = _chunks(6)
    f, tickets = _write_file(eng, tmp_path / "f", chunks)
    for t in tickets:
        eng.wait_write(t, CH, "f")
    os.close(f.fd)
    assert (tmp_path / "f").read_bytes() == b"".join(v.tobytes() for _, v in chunks)
    assert eng._eng.wait_write(tickets[0]) == (0, errno.EINVAL)  # taken already
    assert eng._eng.wait_write(10 ** 9) == (0, errno.EINVAL)     # never submitted


def test_seal_file_syncs_renames_and_syncs_the_directory(tmp_path, eng):
    chunks = _chunks(4, seed=1)
    f, tickets = _write_file(eng, tmp_path / ".tmp-a", chunks)
    err, step = eng.seal_file(f.fd, tickets[0], tickets[-1], True, str(tmp_path / ".tmp-a"),
                              str(tmp_path / "a"), str(tmp_path))
    assert (err, step) == (0, cio.SEAL_DONE)
    os.close(f.fd)
    assert not (tmp_path / ".tmp-a").exists()
    assert (tmp_path / "a").read_bytes() == b"".join(v.tobytes() for _, v in chunks)
    for t in tickets:  # seal_file waited for them, and left their results to be taken
        eng.wait_write(t, CH, "a")


def test_a_failed_write_stops_the_seal_before_the_rename(tmp_path, eng):
    chunks = _chunks(4, seed=2)
    eng.set_faults(cio.FAULT_NO_SPACE, nospace_after=2 * CH)  # the third chunk fails
    f, tickets = _write_file(eng, tmp_path / ".tmp-b", chunks)
    err, step = eng.seal_file(f.fd, tickets[0], tickets[-1], True, str(tmp_path / ".tmp-b"),
                              str(tmp_path / "b"), str(tmp_path))
    assert (err, step) == (errno.ENOSPC, cio.SEAL_WRITES)
    assert (tmp_path / ".tmp-b").exists() and not (tmp_path / "b").exists()
    results = [eng._eng.wait_write(t) for t in tickets]
    assert results[0] == (CH, 0) and results[-1][1] == errno.ENOSPC
    os.close(f.fd)

    # The next file's seal does not inherit that failure.
    eng.set_faults(0)
    chunks = _chunks(2, seed=3)
    f, tickets = _write_file(eng, tmp_path / ".tmp-c", chunks)
    assert eng.seal_file(f.fd, tickets[0], tickets[-1], False, str(tmp_path / ".tmp-c"), str(tmp_path / "c"),
                         str(tmp_path)) == (0, cio.SEAL_DONE)
    os.close(f.fd)
    assert (tmp_path / "c").read_bytes() == b"".join(v.tobytes() for _, v in chunks)


def test_a_failed_rename_is_reported_with_its_step(tmp_path, eng):
    chunks = _chunks(1, seed=4)
    f, tickets = _write_file(eng, tmp_path / ".tmp-d", chunks)
    err, step = eng.seal_file(f.fd, tickets[0], tickets[-1], True, str(tmp_path / ".tmp-d"),
                              str(tmp_path / "no-such-dir" / "d"), str(tmp_path))
    os.close(f.fd)
    assert (err, step) == (errno.ENOENT, cio.SEAL_RENAME)
    assert (tmp_path / ".tmp-d").exists()


def test_seal_files_publishes_a_group_in_order_up_to_the_first_failure(tmp_path, eng):
    groups = [_chunks(3, seed=10 + i) for i in range(3)]
    files = []
    for i, chunks in enumerate(groups):
        f, tickets = _write_file(eng, tmp_path / f".tmp-g{i}", chunks)
        files.append((f.fd, tickets[0], tickets[-1], str(tmp_path / f".tmp-g{i}"), str(tmp_path / f"g{i}")))
    assert eng.seal_files(files, True, str(tmp_path)) == (0, cio.SEAL_DONE, 3)
    for i, chunks in enumerate(groups):
        os.close(files[i][0])
        assert (tmp_path / f"g{i}").read_bytes() == b"".join(v.tobytes() for _, v in chunks)
        assert not (tmp_path / f".tmp-g{i}").exists()

    # The second file cannot be flushed (its fd is closed once its writes are done): the
    # first is published, the second and third are not (a group stops at its first failure).
    files = []
    for i, chunks in enumerate(_chunks(2, seed=20 + i) for i in range(3)):
        f, tickets = _write_file(eng, tmp_path / f".tmp-h{i}", chunks)
        files.append((f.fd, tickets[0], tickets[-1], str(tmp_path / f".tmp-h{i}"), str(tmp_path / f"h{i}")))
    for t in range(files[1][1], files[1][2] + 1):
        eng.wait_write(t, CH, "h1")
    os.close(files[1][0])
    assert eng.seal_files(files, True, str(tmp_path)) == (errno.EBADF, cio.SEAL_SYNC, 1)
    os.close(files[0][0])
    os.close(files[2][0])
    assert (tmp_path / "h0").exists() and not (tmp_path / ".tmp-h0").exists()
    assert (tmp_path / ".tmp-h1").exists() and (tmp_path / ".tmp-h2").exists()
    assert not (tmp_path / "h1").exists() and not (tmp_path / "h2").exists()

    # A failed write: that file and the ones after it stay unpublished.
    eng.set_faults(cio.FAULT_NO_SPACE, nospace_after=0)
    f, tickets = _write_file(eng, tmp_path / ".tmp-i", _chunks(1, seed=30))
    assert eng.seal_files([(f.fd, tickets[0], tickets[-1], str(tmp_path / ".tmp-i"), str(tmp_path / "i"))], True,
                          str(tmp_path)) == (errno.ENOSPC, cio.SEAL_WRITES, 0)
    os.close(f.fd)
    eng.set_faults(0)
    assert not (tmp_path / "i").exists()
    assert eng.seal_files([], True, str(tmp_path)) == (0, cio.SEAL_DONE, 0)


def test_large_staging_starts_on_a_huge_page_boundary():
    small, _ = cio.staging(1 << 20)
    large, view = cio.staging(5 << 20)
    assert small.address % cio.ALIGN == 0
    assert large.address % (2 << 20) == 0
    assert large.size == 5 << 20 and not view.any()  # zeroed, like every staging buffer
