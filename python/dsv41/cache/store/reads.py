"""RecordReader: verified reads, records read whole and checked before their payload is used.

Host path (read_checked): O_DIRECT reads into aligned staging; each record is checked in
the I/O worker that read it (C++, dsv41/record.h), and its payload copied out by the pass
that checksums it. Device path (read_into): device.DevicePath. Both check the link to
the parent, and both group records back to back in one segment into one I/O
(plan.plan_reads).

A failed read never removes a record (settle). An I/O error, a short read, a segment that
would not open or a failed device read is a miss ("io"): counted, and the device path
hands its records to the host path. Only a verified mismatch of the bytes (header, data
CRC, the link to the parent, a file shorter than the record) removes a record, and a
device read's verdict is first confirmed by the host path.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from .device import DevicePath
from .fds import SegmentFds
from .index import SegmentFile
from .plan import RECORD_STATUS, plan_reads
from .staging import StagingPool
from .state import StoreState

__all__ = ["RecordReader", "READ_BATCH"]

log = logging.getLogger("dsv41.cache.store")

READ_BATCH = 64 << 20  # payload bytes one load() reads per call
_TRUNCATED = RECORD_STATUS.index("truncated")


def _file_ends_before(seg: SegmentFile, end: int) -> bool:
    """Whether segment file `seg` holds no bytes at `end` or beyond (its size, by fstat
    on the fd the read used): then a read that stopped there was cut by the file's end."""
    try:
        return seg.fd is not None and os.fstat(seg.fd).st_size <= end
    except OSError:
        return False


class RecordReader:
    def __init__(self, state: StoreState, fds: SegmentFds, staging: StagingPool):
        self._state = state
        self._fds = fds
        self._staging = staging
        self.device = DevicePath(state, fds)

    def read_checked(self, recs: list, tokens: np.ndarray | None, key: bytes | None, out: np.ndarray | None,
                     links: bool = False) -> tuple[list[str], tuple, dict[int, int]]:
        """Reads records (None entries are "missing") and checks each one in the I/O worker
        that read it (dsv41/record.h): header and data CRC, identity against the index,
        then token ids (row i of tokens) and key when given, and with `links` the link to
        its parent. Verified payloads go to row i of out, copied by the pass that
        checksums them. Returns (statuses, the staging buffer item, record index -> its
        offset in the staging buffer). The caller holds a read (SegmentFds.reading) and
        hands the item back (StagingPool.put)."""
        state = self._state
        status = ["ok"] * len(recs)
        with state.lock:
            groups, fds = plan_reads(state, self._fds, recs, status, links)
        item = self._staging.get(sum(g[2] for g in groups))
        buf = item[0]
        ops, where, pos = [], {}, 0
        for seg, base, size, members, _, specs in groups:
            ops.append((fds[seg.uuid], base, size, buf, pos, specs))
            for i, spec in zip(members, specs):
                where[i] = pos + spec[0]
            pos += size
        try:
            results = state.engine.read_records(ops, tokens, key, None if out is None else out.reshape(-1),
                                                state.identity.block_bytes)
        except BaseException:
            self._staging.put(item)
            raise
        for g, (done, err, codes) in zip(groups, results):
            if not err and not any(codes):
                continue  # every record of this op passed
            for i, code, spec in zip(g[3], codes, g[5]):
                status[i] = RECORD_STATUS[code]
                if code == _TRUNCATED and done < spec[0] + spec[1]:
                    # The read stopped inside this record: an I/O error, or a short read
                    # that proves damage only if the file really ends there.
                    if not err and _file_ends_before(g[0], g[1] + done):
                        continue
                    status[i] = "io"
                    state.metrics.read_errors.inc(tier="ssd", kind="read" if err else "short")
        return status, item, where

    def read(self, rids: list[int], tokens: np.ndarray | None, key: bytes, out: np.ndarray | None) -> list[str]:
        """PersistentStore.read: records `rids` read, verified, their payloads copied into
        the rows of `out`; one status each (the facade's docstring lists them)."""
        if not rids:
            return []
        state = self._state
        t0 = time.perf_counter()
        P = state.identity.block_bytes
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype="<u4")
            if tokens.ndim != 2 or tokens.shape[0] < len(rids):
                raise ValueError(f"tokens must be uint32 [{len(rids)}, T], got {tokens.shape}")
        if out is not None and (out.dtype != np.uint8 or out.size < len(rids) * P or not out.flags.c_contiguous):
            raise ValueError(f"out must be contiguous uint8 [{len(rids)}, {P}]")
        with self._fds.reading():
            with state.lock:
                recs = [state.index.recs.get(rid) for rid in rids]
            status, item, _ = self.read_checked(recs, tokens, key, out, links=True)
            self._staging.put(item)  # the verified payloads are in out already
        self._settle(rids, recs, status, t0)
        return status

    def read_into(self, rids: list[int], tokens: np.ndarray | None, key: bytes, dst: torch.Tensor) -> list[str]:
        """read() into rows of a tensor on any device: the device path first (DevicePath),
        then the host path for every record the device path did not verify; the host
        path's verdict is final. When the host path serves what the device path could not,
        the device path steps aside for this store."""
        if not rids:
            return []
        state = self._state
        t0 = time.perf_counter()
        P = state.identity.block_bytes
        if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != P or dst.shape[0] < len(rids):
            raise ValueError(f"dst must be uint8 [{len(rids)}, {P}]")
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype="<u4")
        status = ["ok"] * len(rids)
        with state.lock:
            recs = [state.index.recs.get(rid) for rid in rids]
        device = self.device
        if device.reason is None:
            why, failed = device.read(recs, tokens, key, dst, status)
        else:
            why, failed = None, set()
            status = ["io" if r is not None else "missing" for r in recs]
        redo = [i for i, st in enumerate(status) if st != "ok" and st != "collision" and recs[i] is not None]
        if redo:
            rows = np.zeros((len(redo), P), np.uint8)
            with self._fds.reading():
                host, item, _ = self.read_checked([recs[i] for i in redo], None if tokens is None else tokens[redo],
                                                  key, rows, links=True)
                self._staging.put(item)
            served = [k for k, st in enumerate(host) if st == "ok"]
            if served:
                idx = torch.tensor([redo[k] for k in served], dtype=torch.long, device=dst.device)
                dst.index_copy_(0, idx, torch.from_numpy(rows[served]).to(dst.device))
            recovered = [redo[k] for k in served if redo[k] in failed]
            if recovered and device.reason is None:
                device.step_aside(why or f"a device read failed its {status[recovered[0]]} check where the "
                                  f"host read of the same record passed")
            for k, i in enumerate(redo):
                status[i] = host[k]
        self._settle(rids, recs, status, t0)
        return status

    def load(self, key: bytes, hashes: list[bytes], tokens: np.ndarray, out: np.ndarray | torch.Tensor | None,
             parent: int = 0) -> list[int]:
        """The longest verified chain for `hashes` (blocks whose token ids are the rows of
        `tokens`) below record `parent`: copies payloads into the rows of `out` (a host
        array, or a tensor on any device: see read_into) and returns the record ids. A
        record that is a collision or fails verification ends the chain there, after any
        other candidate for that block has been tried."""
        state = self._state
        loaded: list[int] = []
        exclude: set[int] = set()
        per = max(1, READ_BATCH // (state.identity.block_bytes + 4096))  # a record: payload + a head of < 4 KiB
        i = 0
        while i < len(hashes):
            chain = state.walk(key, hashes[i:], loaded[-1] if loaded else parent, exclude)
            if not chain:
                break
            stopped = False
            for s in range(0, len(chain), per):
                part = chain[s: s + per]
                rows = None if out is None else out[i: i + len(part)]
                if isinstance(out, torch.Tensor):
                    st = self.read_into(part, tokens[i: i + len(part)], key, rows)
                else:
                    st = self.read(part, tokens[i: i + len(part)], key, rows)
                k = next((j for j, x in enumerate(st) if x != "ok"), len(st))
                loaded += part[:k]
                i += k
                if k < len(part):
                    exclude.add(part[k])  # then look for another candidate for block i
                    stopped = True
                    break
            if not stopped:
                break
        if loaded:
            state.touch(loaded)
        return loaded

    def _settle(self, rids, recs, status, t0) -> None:
        """Counts a batch's outcome. A record whose bytes proved damaged (plan.DAMAGED) is
        removed with its subtree; one whose segment file is gone is forgotten in memory
        (the files are the truth: a restart would not find it either). Nothing else
        removes anything: an "io" status is a miss, counted in read_errors where it
        happened; a collision is intact, another prefix's record."""
        state = self._state
        metrics, P = state.metrics, state.identity.block_bytes
        if status.count("ok") == len(status):
            metrics.bytes_read.inc(len(status) * P, tier="ssd")
            metrics.ssd_read_seconds.observe(time.perf_counter() - t0)
            return
        good_bytes = 0
        for i, st in enumerate(status):
            if st == "ok":
                good_bytes += P
            elif st == "collision":
                metrics.collisions.inc(tier="ssd")
            elif st != "io":
                with state.lock:
                    moved = recs[i] is not None and state.index.recs.get(rids[i]) is not recs[i]
                if moved:
                    continue  # compaction moved it while we read the old copy: just a miss
                metrics.checksum_failures.inc(kind=st)
                if st == "missing":
                    state.forget(rids[i], "missing")
                    continue
                log.warning("persistent record %d failed verification (%s): removed, served as a miss",
                            rids[i], st)
                if state.writable:
                    state.delete(rids[i], "corruption")
                else:
                    state.forget(rids[i], "corruption")
        metrics.bytes_read.inc(good_bytes, tier="ssd")
        metrics.ssd_read_seconds.observe(time.perf_counter() - t0)
