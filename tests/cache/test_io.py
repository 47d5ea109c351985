"""The C++ I/O engine: CRC-32C against published vectors, and the pread/pwrite paths
(O_DIRECT, the buffered fallback, unaligned reads, short reads, disk full)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from dsv41 import _C
from dsv41.cache import io

# RFC 3720 (iSCSI) appendix B.4 and the common check value.
VECTORS = [(b"123456789", 0xE3069283), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
           (bytes(range(32)), 0x46DD794E), (bytes(range(31, -1, -1)), 0x113FDB5C), (b"", 0)]


PATHS = _C.io.crc32c_paths()  # the host CRC paths this CPU has: sw, hw, fold256, fold512


@pytest.mark.parametrize("data, want", VECTORS)
def test_crc32c_vectors(data, want):
    assert io.crc32c(data) == want and io.crc32c_sw(data) == want
    for path in PATHS:
        assert _C.io.crc32c_path(path, data) == want, path


def test_crc32c_backend_is_the_widest_path_the_cpu_has():
    names = {"sw": "slice-by-8", "hw": "sse4.2", "fold256": "avx2-vpclmulqdq", "fold512": "avx512-vpclmulqdq"}
    assert _C.io.crc32c_backend() == names[PATHS[-1]] and PATHS[0] == "sw"
    missing = [p for p in names if p not in PATHS]
    for path in missing:
        with pytest.raises(RuntimeError, match="no"):
            _C.io.crc32c_path(path, b"x")


@pytest.mark.skipif(len(PATHS) < 2, reason="no hardware CRC-32C on this CPU")
@pytest.mark.parametrize("path", PATHS[1:])
def test_crc32c_paths_and_fused_copies_agree_with_slice_by_8_everywhere(path):
    """Each hardware path (folding takes 256 bytes and more), alone and with the copy a
    verified read (plain stores) and a record encode (non-temporal stores where dst is
    aligned) make in the same pass, at every length around their block sizes (16, 32, 64,
    256 bytes), at odd alignments of source and destination, from a nonzero CRC."""
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 200_000, dtype=np.uint8)
    lengths = list(range(0, 1100)) + [4095, 4096, 4097, 3 * 4096 * 2 + 13, 56_960, 61_440, 131_071, 199_000]
    _, out = io.staging(200_128)  # page-aligned: at offsets 32 and 64 stores can be streamed
    for start in (0, 1, 5, 8, 63):
        for n in lengths:
            piece = data[start:start + n]
            seed = 0 if n % 2 else 0x9E3779B9
            ref = io.crc32c_sw(piece, seed)
            assert _C.io.crc32c_path(path, piece, seed) == ref, (start, n)
            if n % 7 == 0 or n > 1000:
                for at, stream in ((3, False), (64, False), (64, True), (32, True), (5, True)):
                    out[:] = 0
                    got = _C.io.crc32c_path(path, piece, seed, out[at:at + n], stream)
                    assert got == ref, (start, n, at, stream)
                    assert np.array_equal(out[at:at + n], piece) and not out[:at].any() and not out[at + n:].any()


def test_crc32c_paths_agree_on_odd_lengths_and_alignments():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 70000, dtype=np.uint8)
    for start, n in [(0, 1), (1, 7), (3, 4095), (5, 12289), (7, 3 * 4096 * 2 + 13), (0, 70000)]:
        piece = data[start:start + n]
        ref = io.crc32c_sw(piece)
        assert io.crc32c(piece) == ref
        # The chunk-and-combine schedule of the CUDA kernel, run on the host.
        for chunks in (1, 3, 256):
            assert _C.io.crc32c_chunked(piece, chunks) == ref
        # Continuation and combination.
        k = n // 3
        a, b = io.crc32c(piece[:k]), io.crc32c(piece[k:])
        assert io.crc32c(piece[k:], a) == ref and io.crc32c_combine(a, b, n - k) == ref


def test_crc32c_lead_rows_writes_each_rows_crc_of_its_rest_and_refuses_partial_rows():
    rng = np.random.default_rng(1)
    for row_bytes in (5, 32, 61):
        rows = rng.integers(0, 256, (9, row_bytes), dtype=np.uint8)
        rest = rows[:, 4:].copy()
        io.crc32c_lead_rows(rows, row_bytes)
        for r in range(9):
            assert int.from_bytes(rows[r, :4].tobytes(), "little") == io.crc32c_sw(rest[r])
        assert np.array_equal(rows[:, 4:], rest)  # the rest is untouched
    with pytest.raises(ValueError, match="whole rows"):
        io.crc32c_lead_rows(np.zeros(33, np.uint8), 32)
    with pytest.raises(ValueError, match="whole rows"):
        io.crc32c_lead_rows(np.zeros(8, np.uint8), 4)


def test_journal_entries_encoded_in_one_pass_equal_those_encoded_one_by_one():
    from dsv41.cache.store import format as sf
    rids = [1, 7, 2**40 + 3, 2**63 - 5]
    many = sf.encode_journal_many(sf.J_ACCESS, rids, 1_234_567_890_123)
    assert many == b"".join(sf.encode_journal(sf.J_ACCESS, r, 1_234_567_890_123) for r in rids)
    assert sf.decode_journal(many) == ([(sf.J_ACCESS, r, 1_234_567_890_123, 0) for r in rids], len(many))
    assert sf.encode_journal_many(sf.J_ACCESS, [], 5) == b""


def _file(tmp_path, data: bytes) -> str:
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize("direct", [True, False])
def test_aligned_reads_and_writes(tmp_path, direct):
    eng = io.IOEngine(threads=3, chunk_bytes=8192)  # small chunks: one op spans several threads
    size = 5 * io.ALIGN * 4
    buf, view = io.staging(size)
    view[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    f = eng.open(str(tmp_path / "w.bin"), os.O_WRONLY | os.O_CREAT, direct=direct)
    assert f.direct == direct or not direct
    [(done, err)] = eng.pwrite([(f.fd, 0, size, buf, 0)])
    eng.fsync(f.fd)
    os.close(f.fd)
    assert (done, err) == (size, 0)
    assert (tmp_path / "w.bin").read_bytes() == view.tobytes()
    rbuf, rview = io.staging(size)
    r = eng.open(str(tmp_path / "w.bin"), os.O_RDONLY, direct=direct)
    res = eng.pread([(r.fd, 0, size // 2, rbuf, 0), (r.fd, size // 2, size // 2, rbuf, size // 2)])
    os.close(r.fd)
    assert res == [(size // 2, 0)] * 2 and np.array_equal(rview, view)
    c = eng.counters()
    assert c["bytes_read"] >= size and c["bytes_written"] >= size
    assert (c["direct_ops"] > 0) == (direct and f.direct)


def test_unaligned_read_on_a_direct_fd_goes_through_a_bounce_buffer(tmp_path):
    data = os.urandom(3 * io.ALIGN + 100)
    eng = io.IOEngine(2)
    f = eng.open(_file(tmp_path, data), os.O_RDONLY, direct=True)
    out = np.zeros(5000, np.uint8)  # numpy buffer, not 4 KiB aligned
    [(done, err)] = eng.pread([(f.fd, 1234, 5000, out, 0)])
    assert (done, err) == (5000, 0) and out.tobytes() == data[1234:6234]
    # A short read at the end of the file reports what was there.
    [(done, err)] = eng.pread([(f.fd, len(data) - 10, 4096, np.zeros(4096, np.uint8), 0)])
    assert (done, err) == (10, 0)
    os.close(f.fd)


def test_refused_o_direct_falls_back_cleanly(tmp_path):
    data = os.urandom(2 * io.ALIGN)
    eng = io.IOEngine(2)
    eng.set_faults(io.FAULT_REFUSE_DIRECT_OPEN)  # as tmpfs did before Linux 6.6
    f = eng.open(_file(tmp_path, data), os.O_RDONLY, direct=True)
    assert not f.direct
    buf, view = io.staging(len(data))
    assert eng.pread([(f.fd, 0, len(data), buf, 0)]) == [(len(data), 0)] and view.tobytes() == data
    os.close(f.fd)
    assert eng.counters()["direct_fallbacks"] == 1
    # Refused at I/O time instead (some FUSE and network filesystems): O_DIRECT is dropped
    # from the fd and the op retried through the page cache.
    eng2 = io.IOEngine(1)
    eng2.set_faults(io.FAULT_REFUSE_DIRECT_IO)
    g = eng2.open(str(tmp_path / "f.bin"), os.O_RDONLY, direct=True)
    view[:] = 0
    assert eng2.pread([(g.fd, 0, len(data), buf, 0)]) == [(len(data), 0)] and view.tobytes() == data
    c = eng2.counters()
    assert c["direct_fallbacks"] == 1 and c["buffered_ops"] >= 1
    os.close(g.fd)


def test_disk_full_is_reported_not_hidden(tmp_path):
    eng = io.IOEngine(1)
    buf, _ = io.staging(4 * io.ALIGN)
    f = eng.open(str(tmp_path / "full.bin"), os.O_WRONLY | os.O_CREAT, direct=True)
    eng.set_faults(io.FAULT_NO_SPACE, nospace_after=io.ALIGN)
    [(done, err)] = eng.pwrite([(f.fd, 0, 4 * io.ALIGN, buf, 0)])
    assert done == io.ALIGN and err == errno.ENOSPC
    with pytest.raises(OSError) as e:
        eng.write_all(f.fd, 0, buf, 0, io.ALIGN)
    assert e.value.errno == errno.ENOSPC
    os.close(f.fd)
    # Bad fds and buffer overruns are errors too.
    assert eng.pread([(-1, 0, 10, np.zeros(10, np.uint8), 0)])[0][1] == errno.EBADF
    with pytest.raises(ValueError, match="overruns"):
        eng.pread([(0, 0, 100, np.zeros(10, np.uint8), 0)])
    with pytest.raises(OSError):
        eng.open(str(tmp_path / "no" / "such"), os.O_RDONLY)


def test_injected_faults_fail_the_chosen_operation_once(tmp_path):
    """The test hook the store's read-fault tests stand on: after `skip` operations the
    next `count` of one kind fail (an errno, or for reads with err 0 a short read)."""
    eng = io.IOEngine(1)
    data = bytes(range(256)) * 64  # 4 pages
    (tmp_path / "f.bin").write_bytes(data)
    f = eng.open(str(tmp_path / "f.bin"), os.O_RDONLY, direct=False)
    buf, view = io.staging(len(data))
    op = [(f.fd, 0, len(data), buf, 0)]
    eng.inject_fault("read", errno.EIO, skip=1)
    assert eng.pread(op) == [(len(data), 0)]  # skipped
    assert eng.pread(op) == [(0, errno.EIO)]
    assert eng.pread(op) == [(len(data), 0)]  # once
    eng.inject_fault("read", 0)
    view[:] = 0
    assert eng.pread(op) == [(len(data) // 2, 0)] and view[: len(data) // 2].tobytes() == data[: len(data) // 2]
    eng.inject_fault("open", errno.EMFILE, count=2)
    for _ in range(2):
        with pytest.raises(OSError) as e:
            eng.open(str(tmp_path / "f.bin"), os.O_RDONLY)
        assert e.value.errno == errno.EMFILE
    os.close(eng.open(str(tmp_path / "f.bin"), os.O_RDONLY).fd)
    eng.inject_fault("read", errno.EIO, count=5)
    eng.inject_fault("read", errno.EIO, count=0)  # disarmed
    assert eng.pread(op) == [(len(data), 0)]
    with pytest.raises(ValueError):
        eng.inject_fault("write", errno.EIO)
    os.close(f.fd)


def test_copies_and_buffers():
    eng = io.IOEngine(2)
    src = torch.arange(5 * 64, dtype=torch.int32).view(torch.uint8).reshape(5, -1).clone()
    dst = torch.zeros_like(src)
    eng.copy_blocks(dst, [4, 0, 2], src, [0, 1, 4])
    assert torch.equal(dst[4], src[0]) and torch.equal(dst[0], src[1]) and torch.equal(dst[2], src[4])
    assert not dst[1].any() and not dst[3].any()
    with pytest.raises(IndexError):
        eng.copy_blocks(dst, [5], src, [0])
    a = np.arange(100, dtype=np.uint8)
    b = np.zeros(100, np.uint8)
    eng.copy_ranges(b, [0, 50], a, [10, 60], 20)
    assert b[:20].tolist() == list(range(10, 30)) and b[50:70].tolist() == list(range(60, 80))
    buf = io.AlignedBuffer(10000)
    assert buf.address % io.ALIGN == 0 and len(np.asarray(buf)) == 10000 and not np.asarray(buf).any()


def test_io_info_reports_the_active_path():
    info = io.io_info()
    assert info["backend"] in ("posix", "gds") and info["crc32c"] in ("avx512-vpclmulqdq", "avx2-vpclmulqdq", "sse4.2", "slice-by-8")


@pytest.mark.no_gpu
def test_io_info_without_a_gpu_is_posix():
    info = io.io_info()
    assert info["backend"] == "posix" and not info["gds_available"] and info["gds_detail"]


def test_gds_failures_are_named():
    """cuFile's failures reach `dsv41 info` and the store's logs by name: an errno as its
    text, a CUfileOpError (>= 5000) with its number (and cufile.h's text where built)."""
    assert io.gds_error_string(-errno.EIO) == os.strerror(errno.EIO)
    assert io.gds_error_string(errno.EACCES) == os.strerror(errno.EACCES)
    assert "5012" in io.gds_error_string(-5012)
    if io.io_info()["cufile_compiled"]:  # cufile.h's names, as its docs and NVIDIA's tools say them
        assert io.gds_error_string(-5027) == "cuFile error 5027 CU_FILE_HANDLE_NOT_REGISTERED " \
                                             "(file descriptor is not registered)"
        assert "CU_FILE_CUDA_POINTER_INVALID" in io.gds_error_string(5012)
        assert "5999" in io.gds_error_string(-5999) and "not listed" in io.gds_error_string(-5999)


@pytest.mark.skipif(io.io_info()["gds_available"], reason="GPUDirect Storage works here")
def test_gds_probe_names_the_step_that_failed_and_leaves_nothing(tmp_path):
    # Which step fails depends on the machine (no GPU: the cuFile open; the H200: its
    # cuFileHandleRegister with CU_FILE_HANDLE_NOT_REGISTERED); that one is named holds on all.
    why = io.gds_probe(str(tmp_path))
    assert why and [s for s in io.GDS_PROBE_STEPS if why.startswith(f"{s} failed: ")], why
    assert not why.startswith(f"{io.GDS_PROBE_STEPS[0]} failed")  # tmp_path is writable
    if "cuFile error" in why:  # a cuFile code comes with its enum name
        assert "CU_FILE_" in why, why
    assert list(tmp_path.iterdir()) == []
    no_dir = io.gds_probe(str(tmp_path / "no" / "such"))
    assert no_dir.startswith(f"{io.GDS_PROBE_STEPS[0]} failed: cannot create it in ") and "such" in no_dir


def test_reads_checksum_ranges_in_the_worker(tmp_path):
    data = os.urandom(3 * io.ALIGN)
    path = _file(tmp_path, data)
    ranges = [(0, 100), (5000, 3000), (4096, 8192)]
    for chunk in (4 << 20, 4096):  # one worker per op, or an op split across workers
        eng = io.IOEngine(2, chunk_bytes=chunk)
        f = eng.open(path, os.O_RDONLY, direct=True)
        buf, view = io.staging(3 * io.ALIGN)
        [(done, err, crcs)] = eng.pread([(f.fd, 0, 3 * io.ALIGN, buf, 0, ranges)])
        assert (done, err) == (3 * io.ALIGN, 0)
        assert crcs == [io.crc32c(data[o:o + n]) for o, n in ranges]
        # Past the end of the file: the ranges the read did not fill get 0.
        [(done, err, crcs)] = eng.pread([(f.fd, 2 * io.ALIGN, 2 * io.ALIGN, buf, 0, [(0, 10), (4096, 10)])])
        assert done == io.ALIGN and crcs == [io.crc32c(data[2 * io.ALIGN:2 * io.ALIGN + 10]), 0]
        with pytest.raises(ValueError, match="outside"):
            eng.pread([(f.fd, 0, 100, buf, 0, [(50, 51)])])
        os.close(f.fd)


def _reference_record(head: bytes, tokens: np.ndarray, key: bytes, payload: np.ndarray) -> np.ndarray:
    """A record laid out field by field in numpy (the format table of docs/cache.md), CRCs
    by the one-shot crc32c: what encode_records must produce byte for byte."""
    from dsv41.cache.store import format as sf
    h = np.frombuffer(head, sf.REC_DTYPE)[0]
    T, K, po, rb = int(h["token_count"]), int(h["key_bytes"]), int(h["payload_offset"]), int(h["record_bytes"])
    rec = np.zeros(sf.record_span(rb), np.uint8)  # zero fill to the span: the next record follows
    rec[256: 256 + 4 * T] = tokens.view(np.uint8)
    rec[256 + 4 * T: 256 + 4 * T + K] = np.frombuffer(key, np.uint8)
    rec[po: rb] = payload
    sealed = sf.pack_record_header(
        record_id=int(h["record_id"]), parent_id=int(h["parent_id"]), created_ns=int(h["created_ns"]),
        block_index=int(h["block_index"]), token_count=T, key_bytes=K, payload_offset=po,
        payload_bytes=int(h["payload_bytes"]), record_bytes=rb, block_hash=bytes(h["block_hash"])[: int(h["hash_bytes"])],
        parent_hash=bytes(h["parent_hash"]), data_crc=io.crc32c(rec[256: rb]))
    rec[:256] = np.frombuffer(sealed, np.uint8)
    return rec


def test_encode_records_matches_the_reference_layout():
    from dsv41.cache.store import format as sf
    rng = np.random.default_rng(5)
    eng = io.IOEngine(3)
    specs, want, at = [], [], 0
    for i, (T, K, P) in enumerate([(16, 40, 5000), (64, 7, 56960), (1, 0, 1), (16, 40, 8192)]):
        tokens = rng.integers(0, 1 << 32, T, dtype=np.uint64).astype("<u4")
        key = bytes(rng.integers(0, 256, K, dtype=np.uint8))
        payload = rng.integers(0, 256, P, dtype=np.uint8)
        po, rb, span = sf.record_geometry(T, K, P)
        head = sf.pack_record_header(record_id=i + 1, parent_id=i, created_ns=123 + i, block_index=i, token_count=T,
                                     key_bytes=K, payload_offset=po, payload_bytes=P, record_bytes=rb,
                                     block_hash=bytes(rng.integers(0, 256, 32, dtype=np.uint8)),
                                     parent_hash=bytes(32), sealed=False)
        specs.append((at, head, tokens, key, payload))
        want.append((at, _reference_record(head, tokens, key, payload)))
        at += span  # packed, as in a segment
    buf, view = io.staging(at)
    view[:] = 0xA5  # stale bytes from an earlier chunk: gaps and padding must be zeroed
    eng.encode_records(buf, specs)
    for off, rec in want:
        assert np.array_equal(view[off: off + rec.size], rec)
    # A head whose geometry disagrees with the buffers, or that overruns the staging, is refused.
    at0, head, tokens, key, payload = specs[0]
    with pytest.raises(ValueError):
        eng.encode_records(buf, [(at0, head, tokens[:-1], key, payload)])
    with pytest.raises(ValueError):
        eng.encode_records(buf, [(view.size - 4096, head, tokens, key, payload)])


def test_pack_record_headers_matches_one_at_a_time():
    """The writer packs a segment's heads in one numpy step: byte for byte the heads that
    pack_record_header(sealed=False) makes one by one (short hashes, keys of two lengths)."""
    from dsv41.cache.store import format as sf
    rng = np.random.default_rng(9)
    T, P = 16, 5000
    n = 5
    keys = [b"k" * 40, b"other key", b"k" * 40, b"k" * 40, b"other key"]
    hashes = [bytes(rng.integers(0, 256, m, dtype=np.uint8)) for m in (32, 32, 20, 0, 32)]
    parents = [bytes(32)] + hashes[:-1]
    rids = [int(x) for x in rng.integers(1, 1 << 62, n)]
    pids = [0] + rids[:-1]
    got = sf.pack_record_headers(record_ids=rids, parent_ids=pids, created_ns=(1 << 60) + 7,
                                 block_indices=list(range(3, 3 + n)), token_count=T,
                                 key_bytes=[len(k) for k in keys], payload_bytes=P, block_hashes=hashes,
                                 parent_hashes=parents)
    for i in range(n):
        po, rb, _ = sf.record_geometry(T, len(keys[i]), P)
        want = sf.pack_record_header(record_id=rids[i], parent_id=pids[i], created_ns=(1 << 60) + 7,
                                     block_index=3 + i, token_count=T, key_bytes=len(keys[i]), payload_offset=po,
                                     payload_bytes=P, record_bytes=rb, block_hash=hashes[i],
                                     parent_hash=parents[i], sealed=False)
        assert got[i: i + 1].tobytes() == want, i
