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

This module is the one place the remote tier imports the record format from. The batch
paths every put and lookup takes (chain_ids, encode_records, verify_records) run in C++
(csrc/io/remote_value.cpp); _chain_step, encode_record and verify_record are the
definitions they are tested against, bit for bit.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from ..._ext import _C
from ..io import crc32c
from ..store.format import (REC_HEADER, REC_HEADER_BYTES, REC_MAGIC, RECORD_FORMAT_VERSION, pack_record_header,
                            record_geometry)

__all__ = ["encode_record", "encode_records", "RecordBatch", "verify_record", "verify_records", "chain_ids",
           "value_bytes", "record_geometry", "Verified", "STATUSES"]

_remote = _C.remote
STATUSES = ("ok", "corrupt", "foreign", "collision")
_DOMAIN_CHAIN = b"dsv41.remote.chain.v1"


def _chain_step(parent: int, tokens: np.ndarray, key: bytes) -> int:
    h = hashlib.sha256(_DOMAIN_CHAIN + parent.to_bytes(8, "little") + tokens.astype("<u4", copy=False).tobytes()
                       + len(key).to_bytes(8, "little") + key).digest()
    return int.from_bytes(h[:8], "little") or 1  # 0 means "no parent"


def chain_ids(tok: np.ndarray, key: bytes, start: int = 0, parent: int = 0) -> list[int]:
    """Chain ids of the blocks tok[start:] (uint32 [n, B]); `parent` is block start-1's.
    _chain_step block after block, in C++ (csrc/io/remote_value.cpp: this runs for every
    block of every remote lookup and put)."""
    return _remote.chain_ids(np.ascontiguousarray(tok[start:], dtype="<u4"), key, parent)


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


class RecordBatch:
    """n block values still to be encoded: encode_records' arguments, checked once, for
    whoever sends them to encode where the bytes are needed. A backend that sends from
    memory registered with its client (Mooncake) encodes straight into a staging buffer it
    keeps (encode_into), with no buffer allocated per put; any other takes values(). Either
    way the bytes are encode_record's. The payload rows are referenced, not copied: they
    must not change until the put is done (the tier's writer owns them)."""

    __slots__ = ("key", "tokens", "payloads", "block_indices", "block_hashes", "parent_hashes", "chain_ids",
                 "parent_chains", "created_ns", "payload_offset", "record_bytes")

    def __init__(self, *, key: bytes, tokens: np.ndarray, payloads: np.ndarray, block_indices, block_hashes,
                 parent_hashes, chain_ids, parent_chains, created_ns: int | None = None):
        self.key = key
        self.tokens = np.ascontiguousarray(tokens, dtype="<u4")
        self.payloads = np.ascontiguousarray(payloads).view(np.uint8)
        n, T = self.tokens.shape
        self.block_indices, self.block_hashes = list(block_indices), list(block_hashes)
        self.parent_hashes, self.chain_ids, self.parent_chains = list(parent_hashes), list(chain_ids), \
            list(parent_chains)
        if not (len(self.payloads) == n == len(self.block_indices) == len(self.block_hashes)
                == len(self.parent_hashes) == len(self.chain_ids) == len(self.parent_chains)):
            raise ValueError("RecordBatch: every argument needs one entry per value")
        self.created_ns = time.time_ns() if created_ns is None else created_ns
        self.payload_offset, self.record_bytes, _ = record_geometry(T, len(key), self.payloads.shape[1])

    def __len__(self) -> int:
        return len(self.block_indices)

    @property
    def nbytes(self) -> int:
        """The values' total length (what a put stores)."""
        return len(self) * self.record_bytes

    def encode_into(self, out: np.ndarray, start: int = 0, stop: int | None = None) -> None:
        """Values start..stop-1 into the rows of out (uint8 [stop - start, record_bytes],
        C-contiguous), in one C++ call (csrc/io/remote_value.cpp)."""
        self._encode(out, slice(start, len(self) if stop is None else stop), self.record_bytes)

    def _encode(self, out: np.ndarray, s: slice, row: int) -> None:
        n = len(range(len(self))[s])
        if out.dtype != np.uint8 or out.shape != (n, row) or not out.flags.c_contiguous:
            raise ValueError(f"RecordBatch: out must be C-contiguous uint8 [{n}, {row}]")
        _remote.encode_values(out, self.tokens[s], self.key, self.payloads[s], self.block_indices[s],
                              self.block_hashes[s], self.parent_hashes[s], self.chain_ids[s], self.parent_chains[s],
                              self.created_ns, self.payload_offset, self.record_bytes)

    def values(self, parts: bool = False) -> list:
        """One value per block, encoded now into one fresh buffer: a row view of it, or with
        parts=True a (head, payload) pair of views whose concatenation is the value (the
        payload is then not copied at all: for a backend that can send a value in pieces)."""
        n, rbytes = len(self), self.record_bytes
        row = self.payload_offset if parts else rbytes
        buf = np.empty((n, row), dtype=np.uint8)
        self._encode(buf, slice(0, n), row)
        flat = memoryview(buf.reshape(-1))
        values = [flat[o: o + row] for o in range(0, n * row, row)]
        if parts:
            P = self.payloads.shape[1]
            pflat = memoryview(self.payloads.reshape(-1))
            return [(v, pflat[i * P: (i + 1) * P]) for i, v in enumerate(values)]
        return values


def encode_records(*, key: bytes, tokens: np.ndarray, payloads: np.ndarray, block_indices, block_hashes,
                   parent_hashes, chain_ids, parent_chains, created_ns: int | None = None, parts: bool = False) -> list:
    """encode_record for n blocks at once (tokens uint32 [n, T], payloads uint8 [n, P]), in
    one C++ call that writes each value and its CRCs in one pass. Returns one value per
    block, whose bytes equal encode_record's: a row view of one buffer, or with parts=True a
    (head, payload) pair of views whose concatenation is the value (RecordBatch.values)."""
    return RecordBatch(key=key, tokens=tokens, payloads=payloads, block_indices=block_indices,
                       block_hashes=block_hashes, parent_hashes=parent_hashes, chain_ids=chain_ids,
                       parent_chains=parent_chains, created_ns=created_ns).values(parts)


def value_bytes(value) -> int:
    """Length of a value given whole or as parts."""
    return sum(len(p) for p in value) if isinstance(value, tuple) else len(value)


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
    if crc32c(v[:252]) != header_crc or magic != REC_MAGIC or version != RECORD_FORMAT_VERSION \
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
                   tokens: np.ndarray, payload_bytes: int,
                   records: np.ndarray | None = None) -> tuple[np.ndarray, str | None]:
    """verify_record for consecutive blocks start, start+1, ... of one chain at once, in one
    C++ call (the same checks, one pass per value; csrc/io/remote_value.cpp). values[j] is
    block start+j's value or None (missing); hashes[j], chain[j] and tokens[j] (uint32
    [n, T]) what block start+j must be; parent_hash / parent_chain block start-1's. Returns
    (payloads, status): payloads uint8 [m, payload_bytes] (rows of one buffer the call
    allocated) of the longest run that passed every check, and the status of the value
    that ended it ("corrupt", "foreign", "collision"; None when the run ended at a missing
    value or at the end). records: the values were read into this array (uint8 [n,
    record_bytes]; values[j], where whole, is its row j): the payloads are then served as
    views into it, without a copy."""
    tokens = np.ascontiguousarray(tokens, dtype="<u4")
    po, rbytes, _ = record_geometry(tokens.shape[1], len(key), payload_bytes)
    want = min(len(values), len(tokens), len(hashes), len(chain))
    out = np.empty((want, payload_bytes), dtype=np.uint8) if records is None else None
    good, failed = _remote.verify_values(list(values[:want]), out, tokens, key, start, list(hashes[:want]),
                                         parent_hash, list(chain[:want]), parent_chain, payload_bytes, po, rbytes)
    status = None
    if failed:
        # The failure is classified by the one-value check (its order of checks decides
        # corrupt / foreign / collision); a value it passes would be a disagreement between the
        # two, which is treated as corrupt rather than served.
        j = good
        st = verify_record(values[j], key=key, block_index=start + j, block_hash=hashes[j],
                           parent_hash=hashes[j - 1] if j else parent_hash,
                           parent_chain=chain[j - 1] if j else parent_chain, chain_id=chain[j],
                           tokens=tokens[j], payload_bytes=payload_bytes).status
        status = st if st != "ok" else "corrupt"
    return (out[:good] if records is None else records[:good, po: po + payload_bytes]), status
