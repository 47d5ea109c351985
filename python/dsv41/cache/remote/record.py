"""Remote values: dsv41's own record around every byte it puts in a remote store.

A remote value is one record in the SSD store's record format (cache/store/format.py:
256-byte header with header and data CRC-32C, then token ids, the cache key encoding and
the payload), without the page padding. It is checked on read exactly like an SSD record,
because neither Mooncake nor Redis checks what it returns (Mooncake returned flipped bytes
with return code 0 in our tests):

    header CRC, magic, version, geometry, data CRC      -> "corrupt" on failure
    the cache key (namespace, model fingerprint, format) -> "foreign" when it differs
    block index, hashes, chain ids, token ids            -> "collision" when they differ

Only "ok" values are served; every other status is a counted miss.

Record ids have no meaning remotely, so the header's record_id / parent_id carry the
value's *chain id*: 64 bits of SHA-256 over the parent's chain id, the block's token ids
and the key. Like the SSD store's parent record ids, it identifies a block's whole prefix
independently of the (pluggable, possibly weak) block hash, so a hash collision at any
depth costs a miss, never wrong KV.

This module is the one place the remote tier imports the record format from.
"""
from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass

import numpy as np

from ..io import crc32c
from ..store.format import (REC_DTYPE, REC_HEADER, REC_HEADER_BYTES, REC_MAGIC, STORE_FORMAT_VERSION,
                            pack_record_header, record_geometry)

__all__ = ["encode_record", "encode_records", "verify_record", "verify_records", "chain_ids", "value_bytes",
           "Verified", "STATUSES"]

STATUSES = ("ok", "corrupt", "foreign", "collision")
_DOMAIN_CHAIN = b"dsv41.remote.chain.v1"


def _chain_step(parent: int, tokens: np.ndarray, key: bytes) -> int:
    h = hashlib.sha256(_DOMAIN_CHAIN + parent.to_bytes(8, "little") + tokens.astype("<u4", copy=False).tobytes()
                       + len(key).to_bytes(8, "little") + key).digest()
    return int.from_bytes(h[:8], "little") or 1  # 0 means "no parent"


def chain_ids(tok: np.ndarray, key: bytes, start: int = 0, parent: int = 0) -> list[int]:
    """Chain ids of the blocks tok[start:] (uint32 [n, B]); `parent` is block start-1's.
    The same bytes as _chain_step, fed to one pre-seeded SHA-256 per block (this runs for
    every block of every remote lookup: the Python work per block is kept to a minimum)."""
    rows = np.ascontiguousarray(tok[start:], dtype="<u4")
    seed = hashlib.sha256(_DOMAIN_CHAIN)
    tail = len(key).to_bytes(8, "little") + key
    flat = memoryview(rows.reshape(-1).view(np.uint8))
    w = rows.shape[1] * 4 if rows.ndim == 2 else 0   # a row may be empty (a snapshot's tail)
    out = []
    for i in range(len(rows)):
        h = seed.copy()
        h.update(parent.to_bytes(8, "little"))
        h.update(flat[i * w: (i + 1) * w])
        h.update(tail)
        parent = int.from_bytes(h.digest()[:8], "little") or 1  # 0 means "no parent"
        out.append(parent)
    return out


def encode_record(*, key: bytes, tokens: np.ndarray, payload, block_index: int, block_hash: bytes,
                  parent_hash: bytes, chain_id: int, parent_chain: int, created_ns: int | None = None) -> bytearray:
    """One remote value: header + token ids + key + payload (64-byte aligned), CRC-32C'd.
    Built in one buffer with one copy of the payload (puts are throughput-bound)."""
    tok = np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)
    pay = memoryview(payload).cast("B") if not isinstance(payload, np.ndarray) \
        else memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    T, K, P = tok.size, len(key), len(pay)
    po, rbytes, _ = record_geometry(T, K, P)
    buf = bytearray(rbytes)   # zero-filled: the alignment gap before the payload is zeros
    mv = memoryview(buf)
    base = REC_HEADER_BYTES
    mv[base: base + 4 * T] = tok.view(np.uint8)
    mv[base + 4 * T: base + 4 * T + K] = key
    mv[po:] = pay
    mv[:base] = pack_record_header(record_id=chain_id, parent_id=parent_chain,
                                   created_ns=time.time_ns() if created_ns is None else created_ns,
                                   block_index=block_index, token_count=T, key_bytes=K, payload_offset=po,
                                   payload_bytes=P, record_bytes=rbytes, block_hash=block_hash,
                                   parent_hash=parent_hash, data_crc=crc32c(mv[base:]))
    return buf


def encode_records(*, key: bytes, tokens: np.ndarray, payloads: np.ndarray, block_indices, block_hashes,
                   parent_hashes, chain_ids, parent_chains, created_ns: int | None = None, parts: bool = False) -> list:
    """encode_record for n blocks of one chain at once (tokens uint32 [n, T], payloads uint8
    [n, P]): token ids, key and the header fields are placed by whole-array copies, so the
    per-block Python work is the CRC calls. Returns one value per block, whose bytes equal
    encode_record's: a row view of one buffer, or with parts=True a (head, payload) pair of
    views whose concatenation is the value (the payload is then not copied at all: for a
    backend that can send a value in pieces)."""
    tokens = np.ascontiguousarray(tokens, dtype="<u4")
    payloads = np.ascontiguousarray(payloads).view(np.uint8)
    n, T = tokens.shape
    P, K = payloads.shape[1], len(key)
    po, rbytes, _ = record_geometry(T, K, P)
    base = REC_HEADER_BYTES
    heads = np.empty((n, po), dtype=np.uint8)   # header, token ids, key, zeros up to the payload
    heads[:, base: base + 4 * T] = tokens.view(np.uint8).reshape(n, 4 * T)
    heads[:, base + 4 * T: base + 4 * T + K] = np.frombuffer(key, dtype=np.uint8)
    heads[:, base + 4 * T + K:] = 0
    head = np.zeros(n, dtype=REC_DTYPE)
    head["magic"], head["version"], head["header_bytes"] = REC_MAGIC, STORE_FORMAT_VERSION, REC_HEADER_BYTES
    head["record_id"], head["parent_id"] = chain_ids, parent_chains
    head["created_ns"] = time.time_ns() if created_ns is None else created_ns
    head["block_index"] = block_indices
    head["token_count"], head["key_bytes"], head["payload_offset"] = T, K, po
    head["payload_bytes"], head["record_bytes"] = P, rbytes
    hv = head.view(np.uint8).reshape(n, REC_HEADER_BYTES)
    for col, hashes in ((_BLOCK_HASH, block_hashes), (_PARENT_HASH, parent_hashes)):
        _place_hashes(hv[:, col: col + 32], hashes)
    hb = {len(h) for h in block_hashes}
    head["hash_bytes"] = hb.pop() if len(hb) == 1 else [len(h) for h in block_hashes]
    hflat, pflat = memoryview(heads.reshape(-1)), memoryview(payloads.reshape(-1))
    # data CRC over [256, record_bytes): the head's tail, continued over the payload row
    head["data_crc"] = [crc32c(pflat[i * P: (i + 1) * P], crc32c(hflat[i * po + base: (i + 1) * po]))
                        for i in range(n)]
    hvflat = memoryview(hv.reshape(-1))
    head["header_crc"] = [crc32c(hvflat[o: o + 252]) for o in range(0, n * base, base)]
    heads[:, :base] = hv
    if parts:
        return [(hflat[i * po: (i + 1) * po], pflat[i * P: (i + 1) * P]) for i in range(n)]
    buf = np.empty((n, rbytes), dtype=np.uint8)
    buf[:, :po] = heads
    buf[:, po:] = payloads
    flat = memoryview(buf.reshape(-1))
    return [flat[o: o + rbytes] for o in range(0, n * rbytes, rbytes)]


def value_bytes(value) -> int:
    """Length of a value given whole or as parts."""
    return sum(len(p) for p in value) if isinstance(value, tuple) else len(value)


_BLOCK_HASH = REC_DTYPE.fields["block_hash"][1]
_PARENT_HASH = REC_DTYPE.fields["parent_hash"][1]


@functools.lru_cache(maxsize=16)
def _expected_header(T: int, K: int, P: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """(template uint8 [1, 256], mask uint8 [256]): the header fields verify_record checks
    that depend only on the geometry, and a mask of every byte it checks (these plus block
    index, chain ids and the first L bytes of both hashes; not flags, reserved bytes,
    created_ns or the CRCs, which are compared separately)."""
    po, rbytes, _ = record_geometry(T, K, P)
    h = np.zeros(1, dtype=REC_DTYPE)
    h["magic"], h["version"], h["header_bytes"] = REC_MAGIC, STORE_FORMAT_VERSION, REC_HEADER_BYTES
    h["token_count"], h["key_bytes"], h["payload_offset"] = T, K, po
    h["payload_bytes"], h["record_bytes"], h["hash_bytes"] = P, rbytes, L
    mask = np.zeros(REC_HEADER_BYTES, dtype=np.uint8)
    for name in ("magic", "version", "header_bytes", "record_id", "parent_id", "block_index", "token_count",
                 "key_bytes", "payload_offset", "payload_bytes", "record_bytes", "hash_bytes"):
        dt, off = REC_DTYPE.fields[name][:2]
        mask[off: off + dt.itemsize] = 0xFF
    mask[_BLOCK_HASH: _BLOCK_HASH + L] = 0xFF
    mask[_PARENT_HASH: _PARENT_HASH + L] = 0xFF
    return h.view(np.uint8).reshape(1, REC_HEADER_BYTES), mask


def _place_hashes(dst: np.ndarray, hashes) -> None:
    """dst uint8 [n, 32] (zeros) <- the hashes, left-aligned (REC_HEADER's 32s fields)."""
    lens = {len(h) for h in hashes}
    if len(lens) == 1:
        L = lens.pop()
        if L:
            dst[:, :L] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, L)
    else:
        for i, h in enumerate(hashes):
            dst[i, : len(h)] = np.frombuffer(h, dtype=np.uint8)


@dataclass
class Verified:
    status: str                      # one of STATUSES
    payload: memoryview | None = None
    tokens: np.ndarray | None = None
    created_ns: int = 0
    chain_id: int = 0


def verify_record(value, *, key: bytes, block_index: int, block_hash: bytes, parent_hash: bytes,
                  parent_chain: int, tokens: np.ndarray | None = None, payload_bytes: int | None = None,
                  chain_id: int | None = None) -> Verified:
    """Checks one remote value against what the caller expects at this place of its chain.
    `tokens` None: the stored token ids are returned for the caller to compare (snapshots:
    their tail length is only known from the record)."""
    v = value if isinstance(value, memoryview) else memoryview(value)
    v = v.cast("B") if v.format != "B" else v
    n = len(v)
    if n < REC_HEADER_BYTES:
        return Verified("corrupt")
    (magic, version, header_bytes, _, rec_id, parent_id, created, index, T, K, po_found, P, rbytes, hb, _,
     bhash, phash, _, data_crc, header_crc) = REC_HEADER.unpack_from(v)
    if crc32c(v[:252]) != header_crc or magic != REC_MAGIC or version != STORE_FORMAT_VERSION \
            or header_bytes != REC_HEADER_BYTES:
        return Verified("corrupt")
    po, want_bytes, _ = record_geometry(T, K, P)
    if po_found != po or rbytes != want_bytes or n != rbytes or crc32c(v[REC_HEADER_BYTES:]) != data_crc:
        return Verified("corrupt")
    if v[REC_HEADER_BYTES + 4 * T: REC_HEADER_BYTES + 4 * T + K] != key:
        return Verified("foreign")  # another namespace, model or payload format
    toks = np.frombuffer(v[REC_HEADER_BYTES: REC_HEADER_BYTES + 4 * T], dtype="<u4")
    same = (index == block_index and hb == len(block_hash) and bhash[:hb] == block_hash
            and phash[:len(parent_hash)] == parent_hash and parent_id == parent_chain
            and (payload_bytes is None or P == payload_bytes)
            and (chain_id is None or rec_id == chain_id)
            and (tokens is None or np.array_equal(toks, np.asarray(tokens, dtype="<u4").reshape(-1))))
    if not same:
        return Verified("collision")
    return Verified("ok", v[po: po + P], toks, created, rec_id)


def verify_records(values, *, key: bytes, start: int, hashes, parent_hash: bytes, chain, parent_chain: int,
                   tokens: np.ndarray, payload_bytes: int) -> tuple[np.ndarray, str | None]:
    """verify_record for consecutive blocks start, start+1, ... of one chain at once: the
    checks are the same, made by whole-array comparisons over one buffer (only the CRCs are
    per block). values[j] is block start+j's value or None (missing); hashes[j], chain[j]
    and tokens[j] (uint32 [n, T]) what block start+j must be; parent_hash / parent_chain
    block start-1's. Returns (payloads, status): payloads uint8 [m, payload_bytes] (a view
    into one buffer the call allocated) of the longest run that passed every check, and the
    status of the value that ended it ("corrupt", "foreign", "collision"; None when the run
    ended at a missing value or at the end)."""
    tokens = np.ascontiguousarray(tokens, dtype="<u4")
    T, K, P = tokens.shape[1], len(key), payload_bytes
    po, rbytes, _ = record_geometry(T, K, P)
    want = min(len(values), len(tokens), len(hashes), len(chain))
    buf = bytearray(want * rbytes)
    mv = memoryview(buf)
    n, stop = 0, None           # rows copied; the index of a value of the wrong size
    for v in values[:want]:
        if v is None:
            break
        if len(v) != rbytes:
            stop = n
            break
        mv[n * rbytes: (n + 1) * rbytes] = v
        n += 1
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(want, rbytes)[:n]
    ok = _rows_ok(rows, mv, n, rbytes, key=key, start=start, hashes=hashes[:n], parent_hash=parent_hash,
                  chain=chain[:n], parent_chain=parent_chain, tokens=tokens[:n], payload_bytes=P, po=po)
    good = n if ok.all() else int(np.argmin(ok))
    status = None
    if good < n or stop is not None:
        # The first failure is classified by the one-value check (its order of checks decides
        # corrupt / foreign / collision); a value it passes would be a disagreement between the
        # two, which is treated as corrupt rather than served.
        j = good
        st = verify_record(values[j], key=key, block_index=start + j, block_hash=hashes[j],
                           parent_hash=hashes[j - 1] if j else parent_hash,
                           parent_chain=chain[j - 1] if j else parent_chain, chain_id=chain[j],
                           tokens=tokens[j], payload_bytes=P).status
        status = st if st != "ok" else "corrupt"
    return rows[:good, po: po + P], status


def _rows_ok(rows: np.ndarray, mv: memoryview, n: int, rbytes: int, *, key, start, hashes, parent_hash, chain,
             parent_chain, tokens, payload_bytes, po) -> np.ndarray:
    """bool [n]: which rows (whole records of the expected size) pass every check."""
    if n == 0:
        return np.ones(0, dtype=bool)
    lens = {len(h) for h in hashes} | {len(parent_hash)}
    if len(lens) != 1:   # hashes of mixed lengths (not produced by one hasher): one by one
        return np.array([verify_record(mv[j * rbytes: (j + 1) * rbytes], key=key, block_index=start + j,
                                       block_hash=hashes[j], parent_hash=hashes[j - 1] if j else parent_hash,
                                       parent_chain=chain[j - 1] if j else parent_chain, chain_id=chain[j],
                                       tokens=tokens[j], payload_bytes=payload_bytes).status == "ok"
                         for j in range(n)], dtype=bool)
    L = lens.pop()
    T, K, base = tokens.shape[1], len(key), REC_HEADER_BYTES
    tmpl, mask = _expected_header(T, K, payload_bytes, L)
    # The header as it must be (every field the one-value check compares), compared in one
    # masked pass; then token ids and key, then the two CRCs.
    exp = np.repeat(tmpl, n, axis=0)
    ev = exp.view(REC_DTYPE).reshape(n)
    ids = np.array(chain, dtype=np.uint64)
    ev["block_index"] = np.arange(start, start + n)
    ev["record_id"] = ids
    ev["parent_id"][0] = parent_chain
    ev["parent_id"][1:] = ids[:-1]
    if L:
        want = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, L)
        exp[:, _BLOCK_HASH: _BLOCK_HASH + L] = want
        exp[0, _PARENT_HASH: _PARENT_HASH + L] = np.frombuffer(parent_hash, dtype=np.uint8)
        exp[1:, _PARENT_HASH: _PARENT_HASH + L] = want[:-1]
    ok = ~((rows[:, :base] ^ exp) & mask).any(axis=1)
    ok &= (rows[:, base: base + 4 * T].view("<u4") == tokens).all(axis=1)
    ok &= (rows[:, base + 4 * T: base + 4 * T + K] == np.frombuffer(key, dtype=np.uint8)).all(axis=1)
    head = np.ndarray((n,), dtype=REC_DTYPE, buffer=rows, strides=(rbytes,))
    ok &= head["header_crc"] == [crc32c(mv[o: o + 252]) for o in range(0, n * rbytes, rbytes)]
    ok &= head["data_crc"] == [crc32c(mv[o + base: o + rbytes]) for o in range(0, n * rbytes, rbytes)]
    return ok
