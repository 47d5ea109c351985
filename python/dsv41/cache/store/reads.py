"""Verified reads: records read whole and checked before their payload is used.

Host path (read_checked): O_DIRECT reads into aligned staging; each record is checked in
the I/O worker that read it (C++, dsv41/record.h), and its payload copied out by the pass
that checksums it. Device path (read_into): cuFile reads into device memory, CRCs computed
there, heads checked on the host by the same C++ check. Both check the link to the parent
there too (_parent_hash), and both group records back to back in one segment into one I/O
(_plan).

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
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .. import io as _io
from . import format as sf
from .index import SegmentFile

if TYPE_CHECKING:
    from .store import PersistentStore

__all__ = ["load", "read", "read_checked", "read_into", "settle"]

log = logging.getLogger("dsv41.cache.store")

READ_BATCH = 64 << 20  # payload bytes one load() reads per call
# Contiguous records read by one op. On the development VM's disk a read costs about one
# request whatever its size, and a 4K-token prefix of v41-flash blocks (3.9 MB) took 8 ops
# at 512 KiB but 4 at 1 MiB, as many as a raw 1 MiB read of its bytes; the checks of one
# op run while the others are still being read.
GROUP_BYTES = 1 << 20
RECORD_STATUS = _io.RECORD_STATUS  # "ok", "truncated", "header", "checksum", "collision", "chain"
# Statuses that prove the bytes on disk are not the record the index holds: the record is
# removed (with its subtree). "missing" (its segment file is gone) forgets it in memory only.
DAMAGED = frozenset(("truncated", "header", "checksum", "chain"))


def _parent_hash(get: Callable, r) -> bytes | None:
    """What a record spec carries for the parent link (dsv41/record.h, checked in C++ with
    the rest of the record): the block hash of the record the index holds under r's
    parent id (None when it holds none: the check fails), or b"" for a chain's first
    record (nothing to check). Ids alone are not enough: two stores merged into one
    directory reuse ids, and a chain must never continue into the other store's records.
    `get` is the index's lookup, called under the store's lock."""
    if not r.parent:
        return b""
    p = get(r.parent)
    return None if p is None else p.hash


def _plan(store: PersistentStore, recs: list, status: list[str], links: bool) -> tuple[list[list], dict]:
    """group_records and each record's spec for read_records in one pass (a 64K-token
    prefix is a thousand records, and this Python runs before its first read): returns
    [segment, file offset, size, [record index, ...], end of its last record, [spec,
    ...]] per I/O, and the segments' fds. Called under store._lock. The parent link of a
    record that follows its parent in `recs` (a chain) is checked against that record's
    hash, which the same read verifies; otherwise against the index's (_parent_hash)."""
    fds: dict[bytes, int | str] = {}
    groups: list[list] = []
    get, g, prev, page = store._ix.recs.get, None, None, sf.PAGE
    for i, r in enumerate(recs):
        if r is None:
            status[i] = "missing"
            prev = None
            continue
        seg = r.seg
        fd = fds.get(seg.uuid)
        if fd is None:
            try:
                fd = fds[seg.uuid] = store._seg_fd(seg)
            except FileNotFoundError:  # the file is gone
                fd = fds[seg.uuid] = "missing"
            except OSError:  # EMFILE, EACCES, a link or FIFO in its place: nothing proven
                fd = fds[seg.uuid] = "io"
        if type(fd) is str:
            status[i] = fd
            if fd == "io":
                store.metrics.read_errors.inc(tier="ssd", kind="open")
            prev = None
            continue
        off, span, parent = r.offset, r.span, r.parent
        end = off + span
        if g is not None and g[0] is seg and g[4] == off and -(-end // page) * page - g[1] <= GROUP_BYTES:
            g[2] = -(-end // page) * page - g[1]
            g[3].append(i)
            g[4] = end
        else:
            lo = off // page * page
            g = [seg, lo, -(-end // page) * page - lo, [i], end, []]
            groups.append(g)
        if not links or not parent:
            ph = b""
        elif prev is not None and prev.rid == parent:
            ph = prev.hash
        else:
            ph = _parent_hash(get, r)
        g[5].append((off - g[1], span, r.rid, parent, r.block_index, r.hash, i, ph))
        prev = r
    return groups, fds


def read_checked(store: PersistentStore, recs: list, tokens: np.ndarray | None, key: bytes | None,
                  out: np.ndarray | None, links: bool = False) -> tuple[list[str], tuple, dict[int, int]]:
    """Reads records (None entries are "missing") and checks each one in the I/O worker
    that read it (dsv41/record.h): header and data CRC, identity against the index, then
    token ids (row i of tokens) and key when given, and with `links` the link to its
    parent (_parent_hash). Verified payloads go to row i of out, copied by the pass that checksums them.
    Returns (statuses, the staging buffer item, record index -> its offset in the staging
    buffer). The caller must _put_staging(item)."""
    status = ["ok"] * len(recs)
    with store._lock:
        groups, fds = _plan(store, recs, status, links)
    item = store._get_staging(sum(g[2] for g in groups))
    buf = item[0]
    ops, where, pos = [], {}, 0
    for seg, base, size, members, _, specs in groups:
        ops.append((fds[seg.uuid], base, size, buf, pos, specs))
        for i, spec in zip(members, specs):
            where[i] = pos + spec[0]
        pos += size
    try:
        results = store._eng.read_records(ops, tokens, key, None if out is None else out.reshape(-1),
                                          store.identity.block_bytes)
    except BaseException:
        store._put_staging(item)
        raise
    for g, (done, err, codes) in zip(groups, results):
        if not err and not any(codes):
            continue  # every record of this op passed
        for i, code, spec in zip(g[3], codes, g[5]):
            status[i] = RECORD_STATUS[code]
            if code == _TRUNCATED and done < spec[0] + spec[1]:
                # The read stopped inside this record: an I/O error, or a short read that
                # proves damage only if the file really ends there.
                if not err and _file_ends_before(g[0], g[1] + done):
                    continue
                status[i] = "io"
                store.metrics.read_errors.inc(tier="ssd", kind="read" if err else "short")
    return status, item, where


_TRUNCATED = RECORD_STATUS.index("truncated")


def _file_ends_before(seg: SegmentFile, end: int) -> bool:
    """Whether segment file `seg` holds no bytes at `end` or beyond (its size, by fstat
    on the fd the read used): then a read that stopped there was cut by the file's end."""
    try:
        return seg.fd is not None and os.fstat(seg.fd).st_size <= end
    except OSError:
        return False


def settle(store: PersistentStore, rids, recs, status, t0) -> None:
    """Counts a batch's outcome. A record whose bytes proved damaged (DAMAGED) is removed
    with its subtree; one whose segment file is gone is forgotten in memory (the files are
    the truth: a restart would not find it either). Nothing else removes anything: an
    "io" status is a miss, counted in read_errors; a collision is intact, another
    prefix's record."""
    if status.count("ok") == len(status):
        store.metrics.bytes_read.inc(len(status) * store.identity.block_bytes, tier="ssd")
        store.metrics.ssd_read_seconds.observe(time.perf_counter() - t0)
        return
    good_bytes = 0
    for i, st in enumerate(status):
        if st == "ok":
            good_bytes += store.identity.block_bytes
        elif st == "collision":
            store.metrics.collisions.inc(tier="ssd")
        elif st == "io":
            continue  # counted where it happened (read_errors)
        else:
            with store._lock:
                moved = recs[i] is not None and store._ix.recs.get(rids[i]) is not recs[i]
            if moved:
                continue  # compaction moved it while we read the old copy: just a miss
            store.metrics.checksum_failures.inc(kind=st)
            if st == "missing":
                _forget(store, rids[i])
                continue
            log.warning("persistent record %d failed verification (%s): removed, served as a miss",
                        rids[i], st)
            if store.writable:
                store._delete(rids[i], "corruption")
            else:
                _forget(store, rids[i])
    store.metrics.bytes_read.inc(good_bytes, tier="ssd")
    store.metrics.ssd_read_seconds.observe(time.perf_counter() - t0)


def _forget(store: PersistentStore, rid: int) -> None:
    """Drops a record and its subtree from the in-memory index only (no journal entry)."""
    with store._lock:
        r = store._ix.recs.get(rid)
        if r is not None:
            for cur in store._ix.remove_subtree(r):
                store.metrics.evictions.inc(tier="ssd", cause="missing" if cur is r else "orphan")


def device_read(store: PersistentStore, seg: SegmentFile, staging: torch.Tensor, size: int, file_off: int,
                dev_off: int) -> tuple[int, str | None]:
    """(bytes read, why it failed or None) of one read into `staging`: cuFile on a CUDA
    device, the engine's pread elsewhere (the CPU runs this path in the tests)."""
    path = store.path / seg.name
    if staging.device.type == "cuda":
        with store._lock:
            f = store._gds_files.get(seg.uuid)
            if f is None:
                if not path.is_file() or path.is_symlink():
                    return 0, f"{path} is not a regular file"
                try:
                    f = store._gds_files[seg.uuid] = _io._io.GdsFile(str(path), False)
                except RuntimeError as e:
                    return 0, str(e)
        n = f.read(staging, size, file_off, dev_off)
        return (n, None) if n >= 0 else (0, f"cuFileRead of {path}: {_io.gds_error_string(n)}")
    with store._lock:
        try:
            fd = store._seg_fd(seg)
        except OSError as e:
            return 0, f"open {path}: {e.strerror or e}"
    [(done, err)] = store._eng.pread([(fd, file_off, size, staging.numpy(), dev_off)])
    return done, (f"pread of {path}: {os.strerror(err)}" if err else None)


def device_crc(store: PersistentStore, staging: torch.Tensor, ranges: list[tuple[int, int]]) -> list[int]:
    if not ranges:
        return []
    if staging.device.type == "cuda":
        off = torch.tensor([o for o, _ in ranges], dtype=torch.long, device=staging.device)
        ln = torch.tensor([n for _, n in ranges], dtype=torch.long, device=staging.device)
        return [c & 0xFFFFFFFF for c in _io._io.crc32c_device(staging, off, ln).cpu().tolist()]
    return store._eng.crc32c_many(staging.numpy(), ranges)


def read_into(store: PersistentStore, rids: list[int], tokens: np.ndarray | None, key: bytes, dst: torch.Tensor) -> list[str]:
    """read() into rows of a tensor on any device. With a CUDA tensor and GPUDirect
    Storage the records go from the SSD straight into device memory; the data CRCs are
    computed there, and only each record's head (header, token ids, key) comes back to
    the host for the remaining checks (the same C++ check as read()). Verified payloads
    are then copied device to device into dst. On the CPU the same steps run with pread
    and the host CRC.

    Every record the device path does not verify goes through the host path (read()'s),
    whose verdict is final: a device read that failed is a miss there, never a damaged
    record. When the host path serves what the device path could not, the device path
    steps aside for this store (device_path_reason says why) and later reads take the
    host path."""
    if not rids:
        return []
    t0 = time.perf_counter()
    P = store.identity.block_bytes
    if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != P or dst.shape[0] < len(rids):
        raise ValueError(f"dst must be uint8 [{len(rids)}, {P}]")
    if tokens is not None:
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
    status = ["ok"] * len(rids)
    with store._lock:
        recs = [store._ix.recs.get(rid) for rid in rids]
    if store.device_path_reason is None:
        why, failed = _device_step(store, recs, tokens, key, dst, status)
    else:
        why, failed = None, set()
        status = ["io" if r is not None else "missing" for r in recs]
    redo = [i for i, st in enumerate(status) if st != "ok" and st != "collision" and recs[i] is not None]
    if redo:
        rows = np.zeros((len(redo), P), np.uint8)
        with store._reading():
            host, item, _ = read_checked(store, [recs[i] for i in redo],
                                         None if tokens is None else tokens[redo], key, rows, links=True)
            store._put_staging(item)
        served = [k for k, st in enumerate(host) if st == "ok"]
        if served:
            idx = torch.tensor([redo[k] for k in served], dtype=torch.long, device=dst.device)
            dst.index_copy_(0, idx, torch.from_numpy(rows[served]).to(dst.device))
        recovered = [redo[k] for k in served if redo[k] in failed]
        if recovered and store.device_path_reason is None:
            store._device_step_aside(why or f"a device read failed its {status[recovered[0]]} check where the "
                                     f"host read of the same record passed")
        for k, i in enumerate(redo):
            status[i] = host[k]
    settle(store, rids, recs, status, t0)
    return status


def _device_step(store: PersistentStore, recs: list, tokens: np.ndarray | None, key: bytes, dst: torch.Tensor,
                 status: list[str]) -> tuple[str | None, set[int]]:
    """The device half of read_into: reads `recs` into device staging, checks them and
    copies the verified payloads into their rows of dst; sets status[i] ("io" where a
    read failed: counted, for the host path to retry). Returns (why a device read
    failed, or None; the records whose device read or check failed)."""
    P = store.identity.block_bytes
    with store._lock:
        groups, _ = _plan(store, recs, status, links=True)
    staging = torch.empty(max(1, sum(g[2] for g in groups)), dtype=torch.uint8, device=dst.device)
    where, got, link, pos, why = {}, {}, {}, 0, None
    for seg, file_off, size, members, _, specs in groups:
        done, err = device_read(store, seg, staging, size, file_off, pos)
        why = why or err
        for i, (rel, span, *_, ph) in zip(members, specs):
            where[i] = pos + rel
            got[i] = span if done >= rel + span else max(0, done - rel)
            link[i] = ph
            if done < rel + span and (err or done < size):
                status[i] = "io"  # failed or short: the host path decides
                store.metrics.read_errors.inc(tier="ssd", kind="device")
                why = why or f"a device read returned {done} of {size} bytes"
        pos += size
    failed = {i for i in range(len(recs)) if status[i] == "io" and i in where}
    live = [i for i in range(len(recs)) if status[i] == "ok"]
    if not live:
        return why, failed
    # The heads come back to the host first: their record_bytes say which range to checksum.
    # A head is header, token ids and key up to the payload: within any intact record's
    # span (a page-rounded head could run past a small packed record's end).
    T = store.identity.block_tokens
    head_bytes = sf.record_geometry(T, len(key), P)[0]
    heads_dev = torch.stack([staging[where[i]: where[i] + head_bytes] if got[i] >= head_bytes
                             else torch.zeros(head_bytes, dtype=torch.uint8, device=dst.device)
                             for i in live])
    heads = heads_dev.cpu().numpy()
    hdr = heads[:, : sf.REC_HEADER_BYTES].copy().view(sf.REC_DTYPE).reshape(-1)
    ranges = []
    for k, i in enumerate(live):
        end = min(int(hdr["record_bytes"][k]), got[i])
        ranges.append((where[i] + sf.REC_HEADER_BYTES, max(0, end - sf.REC_HEADER_BYTES)))
    crcs = device_crc(store, staging, ranges)
    specs = [(k * head_bytes, recs[i].span, recs[i].rid, recs[i].parent, recs[i].block_index, recs[i].hash,
              i, crcs[k], got[i], link[i]) for k, i in enumerate(live)]
    codes = _io._io.check_heads(heads.reshape(-1), specs, tokens, key, P, head_bytes)
    for i, code in zip(live, codes):
        status[i] = RECORD_STATUS[code]
        if code and status[i] != "collision":
            failed.add(i)
    for k, i in enumerate(live):
        if status[i] == "ok":
            po = int(hdr["payload_offset"][k])
            dst[i].copy_(staging[where[i] + po: where[i] + po + P], non_blocking=True)
    return why, failed


def read(store: PersistentStore, rids: list[int], tokens: np.ndarray | None, key: bytes, out: np.ndarray | None) -> list[str]:
    """Reads and verifies records `rids` (one per row of `tokens`, uint32 [n, T]); copies
    the payload of each verified one into row i of `out` (uint8 [n, block_bytes]).

    Returns one status per record: "ok", "collision" (intact but another prefix: token
    ids or key differ), or the failure that removed it: "missing", "truncated",
    "header", "checksum", "io", "chain" (its parent hash is not its parent's block hash).
    With tokens None the token ids are not compared.
    """
    if not rids:
        return []
    t0 = time.perf_counter()
    P = store.identity.block_bytes
    if tokens is not None:
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
        if tokens.ndim != 2 or tokens.shape[0] < len(rids):
            raise ValueError(f"tokens must be uint32 [{len(rids)}, T], got {tokens.shape}")
    if out is not None and (out.dtype != np.uint8 or out.size < len(rids) * P or not out.flags.c_contiguous):
        raise ValueError(f"out must be contiguous uint8 [{len(rids)}, {P}]")
    with store._lock:
        recs = [store._ix.recs.get(rid) for rid in rids]
        store._active_reads += 1
    try:
        status, item, _ = read_checked(store, recs, tokens, key, out, links=True)
        store._put_staging(item)  # the verified payloads are in out already
    finally:
        store._end_read()
    settle(store, rids, recs, status, t0)
    return status


def load(store: PersistentStore, key: bytes, hashes: list[bytes], tokens: np.ndarray, out: np.ndarray | torch.Tensor | None,
         parent: int = 0) -> list[int]:
    """The longest verified chain for `hashes` (blocks whose token ids are the rows of
    `tokens`) below record `parent`: copies payloads into the rows of `out` (a host
    array, or a tensor on any device: see read_into) and returns the record ids. A record that is a collision or fails verification ends the chain
    there, after any other candidate for that block has been tried."""
    loaded: list[int] = []
    exclude: set[int] = set()
    per = max(1, READ_BATCH // _span_guess(store))
    i = 0
    while i < len(hashes):
        chain = store.walk(key, hashes[i:], loaded[-1] if loaded else parent, exclude)
        if not chain:
            break
        stopped = False
        for s in range(0, len(chain), per):
            part = chain[s: s + per]
            rows = None if out is None else out[i: i + len(part)]
            if isinstance(out, torch.Tensor):
                st = read_into(store, part, tokens[i: i + len(part)], key, rows)
            else:
                st = read(store, part, tokens[i: i + len(part)], key, rows)
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
        store.touch(loaded)
    return loaded


def _span_guess(store: PersistentStore) -> int:
    """About the bytes one record takes (payload plus a head of a few KiB at most)."""
    return store.identity.block_bytes + 4096
