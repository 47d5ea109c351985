"""Python face of the C++ I/O engine (csrc/io, bound as dsv41._C.io).

    eng = IOEngine(threads=4)
    f = eng.open(path, os.O_RDONLY)             # O_DIRECT where the filesystem accepts it
    buf = AlignedBuffer(1 << 20)                # 4 KiB-aligned staging (np.asarray(buf) views it)
    eng.pread([(f.fd, 0, 1 << 20, buf, 0)])     # -> [(bytes_read, errno)], GIL released
    crc32c(b"123456789") == 0xE3069283

`io_info()` says which path is active: "gds" (GPUDirect Storage through libcufile, loaded
at run time) when dsv41 was built with CUDA and cuFile headers and a GPU, its driver and
the library are present, else "posix" (pread/pwrite, O_DIRECT with 4 KiB alignment where
the filesystem accepts it, page cache otherwise).
"""
from __future__ import annotations

import errno
import glob
import os
import site
import sysconfig
import tempfile
from dataclasses import dataclass

import numpy as np

from .._ext import _C

__all__ = ["IOEngine", "OpenFile", "AlignedBuffer", "GdsFile", "ALIGN", "RECORD_ALIGN", "HUGE_BYTES", "crc32c",
           "crc32c_lead_rows", "crc32c_sw", "crc32c_combine", "crc32c_device", "check_heads", "io_info", "align_up",
           "gds_error_string", "gds_probe", "GDS_PROBE_STEPS", "FAULT_REFUSE_DIRECT_OPEN", "FAULT_REFUSE_DIRECT_IO",
           "FAULT_NO_SPACE", "FAULT_SLOW_SEAL", "SEAL_WRITES", "SEAL_SYNC", "SEAL_RENAME", "SEAL_DIR_SYNC", "SEAL_DONE"]

_io = _C.io
ALIGN: int = _io.ALIGN
RECORD_ALIGN: int = _io.RECORD_ALIGN  # records are packed at this in a segment (dsv41/record.h)
HUGE_BYTES: int = _io.HUGE_BYTES  # AlignedBuffers of this size or more are huge-page backed, in whole pages
AlignedBuffer = _io.AlignedBuffer
GdsFile = _io.GdsFile  # GdsFile(path): a cuFile handle; read(dst, size, file_offset, dev_offset)
FAULT_REFUSE_DIRECT_OPEN: int = _io.FAULT_REFUSE_DIRECT_OPEN
FAULT_REFUSE_DIRECT_IO: int = _io.FAULT_REFUSE_DIRECT_IO
FAULT_NO_SPACE: int = _io.FAULT_NO_SPACE
FAULT_SLOW_SEAL: int = _io.FAULT_SLOW_SEAL
RECORD_STATUS: tuple[str, ...] = _io.RECORD_STATUS  # codes of IoEngine.read_records
# IOEngine.seal_file's steps, in order
SEAL_WRITES: int = _io.SEAL_WRITES
SEAL_SYNC: int = _io.SEAL_SYNC
SEAL_RENAME: int = _io.SEAL_RENAME
SEAL_DIR_SYNC: int = _io.SEAL_DIR_SYNC
SEAL_DONE: int = _io.SEAL_DONE


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of a bytes-like object (hardware instruction where the CPU has it)."""
    return _io.crc32c(data, crc)


def crc32c_lead_rows(rows, row_bytes: int) -> None:
    """In place, for each row_bytes-long row of the writable buffer `rows`: its first 4
    bytes = CRC-32C of the rest, little-endian (journal entries, a batch in one call)."""
    _io.crc32c_lead_rows(rows, row_bytes)


def crc32c_sw(data, crc: int = 0) -> int:
    return _io.crc32c_sw(data, crc)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    return _io.crc32c_combine(crc_a, crc_b, len_b)


@dataclass
class OpenFile:
    fd: int
    direct: bool
    path: str


class IOEngine:
    """A pool of I/O threads; every call blocks until its whole batch is done."""

    def __init__(self, threads: int = 4, chunk_bytes: int = 4 << 20, write_depth: int = 2):
        self._eng = _io.IoEngine(max(1, int(threads)), int(chunk_bytes), max(1, int(write_depth)))

    @property
    def threads(self) -> int:
        return self._eng.threads

    def open(self, path: str, flags: int, mode: int = 0o644, direct: bool = True) -> OpenFile:
        fd, is_direct = self._eng.open(os.fspath(path), flags, mode, direct)
        if fd < 0:
            raise OSError(-fd, os.strerror(-fd), os.fspath(path))
        return OpenFile(fd, is_direct, os.fspath(path))

    def pread(self, ops: list) -> list[tuple[int, int]]:
        """ops: [(fd, file_offset, length, buffer, buffer_offset)] -> [(bytes_read, errno)]."""
        return self._eng.pread(ops)

    def pwrite(self, ops: list) -> list[tuple[int, int]]:
        return self._eng.pwrite(ops)

    def write_all(self, fd: int, offset: int, buf, buf_offset: int, length: int, path: str = "") -> None:
        """One write that must complete; raises OSError (errno ENOSPC, EFBIG, ...) if not."""
        [(done, err)] = self._eng.pwrite([(fd, offset, length, buf, buf_offset)])
        if err or done != length:
            err = err or 5  # EIO for a short write without an errno
            raise OSError(err, os.strerror(err), path)

    def submit_write(self, fd: int, offset: int, buf, buf_offset: int, length: int) -> int:
        """Queues one write for the engine's writer threads (write_depth of them issue the
        queue in order, without coming back to Python between writes) and returns a
        ticket for wait_write. `buf` must stay alive and unchanged until then."""
        return self._eng.submit_write(fd, offset, buf, buf_offset, length)

    def wait_write(self, ticket: int, length: int, path: str = "") -> None:
        """Waits for a submit_write; raises OSError (ENOSPC, EIO for a short write, ...)
        if it did not write all `length` bytes."""
        done, err = self._eng.wait_write(ticket)
        if err or done != length:
            err = err or 5
            raise OSError(err, os.strerror(err), path)

    def seal_file(self, fd: int, first_ticket: int, last_ticket: int, durable: bool, tmp: str, dst: str,
                  directory: str) -> tuple[int, int]:
        """Waits for the submit_writes up to last_ticket; unless one of first_ticket..
        last_ticket failed: fdatasync(fd) (durable), rename(tmp, dst), fsync(directory)
        (durable), all without coming back to Python. Returns (errno, step): errno 0 when
        every step succeeded, else the step it failed at (SEAL_WRITES, SEAL_SYNC,
        SEAL_RENAME, SEAL_DIR_SYNC); dst exists once step > SEAL_RENAME."""
        return self._eng.seal_file(fd, first_ticket, last_ticket, durable, tmp, dst, directory)

    def seal_files(self, files: list[tuple[int, int, int, str, str]], durable: bool,
                   directory: str) -> tuple[int, int, int]:
        """seal_file of several files [(fd, first_ticket, last_ticket, tmp, dst)] as one
        group (a commit's segments): waits for every write, then, in order up to the first
        failure, fdatasync (durable) and rename; one fsync of the directory. Every flush
        comes after every file's writes (include/dsv41/io.h says why). Returns (errno,
        step, renamed): (0, SEAL_DONE, len(files)) when all succeeded, else the step of
        the first failure; files[:renamed] exist under their dst names."""
        return self._eng.seal_files(files, durable, directory)

    def encode_records(self, buf, specs: list) -> None:
        """Writes records into buf on the engine's threads: specs [(offset, head, token ids,
        key, payload)], head from store.format.pack_record_header(sealed=False); each
        record's data and header CRCs are computed right after its bytes are copied."""
        self._eng.encode_records(buf, specs)

    def crc32c_many(self, buf, ranges: list[tuple[int, int]]) -> list[int]:
        return self._eng.crc32c_many(buf, ranges)

    def copy_ranges(self, dst, dst_off: list[int], src, src_off: list[int], length: int) -> None:
        """dst[dst_off[i]: dst_off[i] + length] = src[src_off[i]: ...] for buffers, in parallel."""
        self._eng.copy_ranges(dst, dst_off, src, src_off, length)

    def copy_blocks(self, dst, dst_idx: list[int], src, src_idx: list[int]) -> None:
        """dst[dst_idx[i]] = src[src_idx[i]] for uint8 [blocks, block_bytes] tensors, host or
        device (device copies are enqueued on the current CUDA stream)."""
        self._eng.copy_blocks(dst, list(dst_idx), src, list(src_idx))

    def fsync(self, fd: int, path: str = "") -> None:
        r = self._eng.fsync(fd)
        if r < 0:
            raise OSError(-r, os.strerror(-r), path)

    def read_records(self, ops: list, tokens, key: bytes | None, out, payload_bytes: int) -> list:
        """Reads ops [(fd, offset, length, buffer, buffer_offset, [record spec, ...])] and
        checks each record in the worker that read it (dsv41/record.h; the bindings say
        what a spec holds); verified payloads go to their row of `out` (flat uint8 or
        None). Returns [(bytes_read, errno, [record status code, ...])] per op."""
        return self._eng.read_records(ops, tokens, key, out, payload_bytes)

    def set_faults(self, faults: int, nospace_after: int = 0) -> None:
        """Test hook: FAULT_* flags (simulated O_DIRECT refusal, disk full after N bytes,
        a slow seal)."""
        self._eng.set_faults(faults, nospace_after)

    def inject_fault(self, op: str, err: int = errno.EIO, skip: int = 0, count: int = 1) -> None:
        """Test hook: after `skip` more operations of kind `op` ("open", or "read": one
        read chunk), the next `count` fail with errno `err`; a read with err 0 comes back
        short instead (half its bytes, no errno). count 0 disarms."""
        kinds = {"open": _io.FAULT_OP_OPEN, "read": _io.FAULT_OP_READ}
        if op not in kinds:
            raise ValueError(f"op is 'open' or 'read', got {op!r}")
        self._eng.inject_fault(kinds[op], int(skip), int(count), int(err))

    def counters(self) -> dict:
        return self._eng.counters()


def staging(size: int, pin: bool = False) -> tuple[AlignedBuffer, np.ndarray]:
    """A 4 KiB-aligned buffer and a uint8 numpy view of it."""
    buf = AlignedBuffer(size, pin)
    return buf, np.asarray(buf)


def _point_at_wheel_cufile() -> None:
    """libcufile from the nvidia-cufile wheel is not on the loader path: name it for the
    engine's dlopen unless the user already chose one."""
    if os.environ.get("DSV41_CUFILE_LIB"):
        return
    roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    for root in roots:
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcufile.so.0"))):
            os.environ["DSV41_CUFILE_LIB"] = lib
            return


def check_heads(heads, specs: list, tokens, key: bytes | None, payload_bytes: int, head_bytes: int) -> list[int]:
    """The host half of a read into device memory: checks each record's head (header,
    token ids, key; specs as the bindings describe) against what the index expects and
    the data CRC computed on the device. Returns a record status code per spec."""
    return _io.check_heads(heads, specs, tokens, key, payload_bytes, head_bytes)


def crc32c_device(data, offsets, lengths):
    """CRC-32C of ranges of a CUDA uint8 tensor (one thread block per range), on the
    current stream; offsets and lengths are CUDA int64 tensors. Needs a CUDA build."""
    return _io.crc32c_device(data, offsets, lengths)


def gds_error_string(code: int) -> str:
    """What a GdsFile result (-errno, or -CUfileOpError) or a cuFile error code means."""
    return _io.gds_error_string(int(code))


_probed: dict[str, str | None] = {}

# The steps of gds_probe, in order; a failure is reported as "<step> failed: <why>".
GDS_PROBE_STEPS = ("write the probe file", "open it for cuFile (driver, open, cuFileHandleRegister)",
                   "cuFileRead into device memory", "compare the bytes read")


def gds_probe(directory: str | None = None) -> str | None:
    """None when a GPUDirect Storage read works in `directory` (default: the temporary
    directory): a known pattern is written there through the page cache, read back by
    cuFile into device memory at a page offset, as the store reads, and compared.
    Otherwise "<step> failed: <why>", the step one of GDS_PROBE_STEPS and the why with
    cuFile's error name where cuFile gave one. Driver open alone proves little: a cuFile
    that opens may still refuse the file (the filesystem, O_DIRECT) or fail the read
    (compatibility mode, the CUDA context). Cached per directory for the process."""
    directory = os.fspath(directory or tempfile.gettempdir())
    if directory in _probed:
        return _probed[directory]
    import torch

    write, open_, read, compare = GDS_PROBE_STEPS
    page = ALIGN
    want = (np.arange(2 * page, dtype=np.int64) * 7 + 3).astype(np.uint8)
    why = None
    try:
        fd, path = tempfile.mkstemp(prefix=".tmp-dsv41-gds-probe-", dir=directory)
    except OSError as e:
        why = f"{write} failed: cannot create it in {directory}: {e.strerror or e}"
    else:
        step = write
        try:
            os.write(fd, want.tobytes())
            os.fsync(fd)
            os.close(fd)
            fd = -1
            step = open_
            f = _io.GdsFile(path, False)
            step = read
            dev = torch.zeros(3 * page, dtype=torch.uint8, device="cuda")
            n = f.read(dev, 2 * page, 0, page)
            if n < 0:
                why = f"{read} failed: {gds_error_string(n)}"
            elif n != 2 * page:
                why = f"{read} failed: read {n} of {2 * page} bytes"
            elif not np.array_equal(dev[page:].cpu().numpy(), want):
                why = f"{compare} failed: cuFileRead returned other bytes than the file holds"
            del f
        except (RuntimeError, OSError) as e:
            why = f"{step} failed: {e}"
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(path)
    _probed[directory] = why
    return why


def io_info() -> dict:
    """Which I/O path is active, for build_info() and `dsv41 info`. GPUDirect Storage
    counts as available only once a probe read (gds_probe) in the temporary directory
    returned the right bytes; gds_detail names the step that failed otherwise."""
    _point_at_wheel_cufile()
    gds_ok, gds_reason = _io.gds_status()
    if gds_ok:
        why = gds_probe()
        if why is not None:
            gds_ok, gds_reason = False, f"{gds_reason}, but a probe read in {tempfile.gettempdir()} failed: {why}"
    return {
        "backend": "gds" if gds_ok else "posix",
        "posix": "pread/pwrite, O_DIRECT (4 KiB aligned) where the filesystem accepts it",
        "gds_available": gds_ok,
        "gds_detail": gds_reason,
        "cufile_compiled": _io.cufile_compiled(),
        "crc32c": _io.crc32c_backend(),
        "cuda_devices": _io.cuda_device_count(),
    }
