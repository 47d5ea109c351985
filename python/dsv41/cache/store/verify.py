"""Full verification (`dsv41 cache verify`): every record read and checked.

Beyond what every read checks (CRCs, identity against the index, the parent's hash), verify
recomputes each block hash with the store's hash function through the public BlockHasher,
and reports what opening the store found: damaged and foreign segments, names that are not
regular files, record ids claimed by two different records.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..hashing import BlockHasher
from . import format as sf
from .commit import Committer
from .fds import SegmentFds
from .index import StoredRecord
from .plan import DAMAGED
from .reads import READ_BATCH, RecordReader
from .staging import StagingPool
from .state import StoreState

__all__ = ["verify"]


def verify(state: StoreState, fds: SegmentFds, staging: StagingPool, reader: RecordReader,
           committer: Committer | None, hash_fn: Callable[[bytes], bytes] | None,
           progress: Callable[[int, int], None] | None = None, repair: bool = False) -> dict:
    """Reads and checks every record (header and data CRC, identity, chain links, and the
    block hash when the hash function is known). With repair (writer only) records whose
    bytes proved damaged are removed; without it they are only reported. A read that
    failed (an I/O error: "io") is reported and never repaired."""
    if repair:
        state.check_writable()
        committer.drain()  # check what is committed, including commits still sealing
    with state.lock:
        recs = sorted(state.index.recs.values(), key=lambda r: (r.seg.seq, r.offset))
        hashes = {r.rid: r.hash for r in recs}
    hasher = None if hash_fn is None else BlockHasher(state.identity.block_tokens, hash_fn, state.identity.hash_name)
    total = sum(r.span for r in recs)
    report = {"records": len(recs), "bytes": total, "ok": 0, "failed": {}, "failed_records": [],
              "damaged_segments": sum(1 for s in state.segments.values() if s.damaged),
              # Problems found while opening: segments of another store (a manifest
              # rewritten for another model makes every segment foreign), names that are
              # links, FIFOs or directories, record ids claimed by two different records.
              "foreign_segments": state.counts["foreign_segments"],
              "unusable_files": list(state.unusable),
              "colliding_records": state.counts["colliding_records"],
              "hash_checked": hash_fn is not None}
    done_bytes = 0
    i = 0
    while i < len(recs):
        batch, size = [], 0
        while i < len(recs) and (not batch or size + recs[i].span <= READ_BATCH):
            batch.append(recs[i])
            size += recs[i].span
            i += 1
        with fds.reading():
            status, item, where = reader.read_checked(batch, None, None, None)
        view = item[1]
        for j, (r, st) in enumerate(zip(batch, status)):
            off = where.get(j)
            if st == "ok":
                st = _verify_links(r, view, off, hashes, hasher)
            if st == "ok":
                report["ok"] += 1
            else:
                report["failed"][st] = report["failed"].get(st, 0) + 1
                report["failed_records"].append({"record_id": r.rid, "segment": r.seg.name,
                                                 "offset": r.offset, "problem": st})
                if st != "io":  # an I/O error is counted in read_errors: nothing proven
                    state.metrics.checksum_failures.inc(kind=st)
                if repair and (st in DAMAGED or st == "hash"):
                    state.delete(r.rid, "corruption")
            done_bytes += r.span
        staging.put(item)
        if progress is not None:
            progress(done_bytes, total)
    if repair:
        state.journal.flush()
    # "io": the read failed and proved nothing, so it is not corruption.
    report["corrupt"] = sum(1 for f in report["failed_records"] if f["problem"] != "io")
    return report


def _verify_links(r: StoredRecord, view: np.ndarray, off: int, hashes: dict, hasher: BlockHasher | None) -> str:
    h = view[off: off + sf.REC_HEADER_BYTES].view(sf.REC_DTYPE)[0]
    hb = int(h["hash_bytes"])
    parent_hash = bytes(h["parent_hash"])[:hb]
    if r.parent and r.parent in hashes and hashes[r.parent] != parent_hash:
        return "chain"
    if hasher is not None:
        base = off + sf.REC_HEADER_BYTES
        tc, kb = int(h["token_count"]), int(h["key_bytes"])
        tokens = view[base: base + 4 * tc].view("<u4")
        key = bytes(view[base + 4 * tc: base + 4 * tc + kb])
        if not r.parent and parent_hash != hasher.root(key):
            return "hash"
        if hasher.block_hash(parent_hash, tokens, key) != r.hash:
            return "hash"
    return "ok"
