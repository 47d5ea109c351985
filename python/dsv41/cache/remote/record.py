"""Remote values: dsv41's own record around every byte it puts in a remote store.

A remote value is one record in the SSD store's record format (cache/store_format.py:
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

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from ..io import crc32c
from ..store_format import (REC_DTYPE, REC_HEADER_BYTES, REC_MAGIC, STORE_FORMAT_VERSION, pack_record_header,
                            record_geometry)

__all__ = ["encode_record", "verify_record", "chain_ids", "Verified", "STATUSES"]

STATUSES = ("ok", "corrupt", "foreign", "collision")
_DOMAIN_CHAIN = b"dsv41.remote.chain.v1"


def _chain_step(parent: int, tokens: np.ndarray, key: bytes) -> int:
    h = hashlib.sha256(_DOMAIN_CHAIN + parent.to_bytes(8, "little") + tokens.astype("<u4", copy=False).tobytes()
                       + len(key).to_bytes(8, "little") + key).digest()
    return int.from_bytes(h[:8], "little") or 1  # 0 means "no parent"


def chain_ids(tok: np.ndarray, key: bytes, start: int = 0, parent: int = 0) -> list[int]:
    """Chain ids of the blocks tok[start:] (uint32 [n, B]); `parent` is block start-1's."""
    out = []
    for row in tok[start:]:
        parent = _chain_step(parent, row, key)
        out.append(parent)
    return out


def encode_record(*, key: bytes, tokens: np.ndarray, payload, block_index: int, block_hash: bytes,
                  parent_hash: bytes, chain_id: int, parent_chain: int, created_ns: int | None = None) -> bytes:
    """One remote value: header + token ids + key + payload (64-byte aligned), CRC-32C'd."""
    tokens = np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)
    pay = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8) if not isinstance(payload, np.ndarray) \
        else np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    T, K, P = tokens.size, len(key), pay.size
    po, rbytes, _ = record_geometry(T, K, P)
    buf = np.zeros(rbytes, dtype=np.uint8)
    base = REC_HEADER_BYTES
    buf[base: base + 4 * T] = tokens.view(np.uint8)
    buf[base + 4 * T: base + 4 * T + K] = np.frombuffer(key, dtype=np.uint8)
    buf[po:] = pay
    head = pack_record_header(record_id=chain_id, parent_id=parent_chain,
                              created_ns=time.time_ns() if created_ns is None else created_ns,
                              block_index=block_index, token_count=T, key_bytes=K, payload_offset=po,
                              payload_bytes=P, record_bytes=rbytes, block_hash=block_hash,
                              parent_hash=parent_hash, data_crc=crc32c(buf[base:]))
    buf[:base] = np.frombuffer(head, dtype=np.uint8)
    return buf.tobytes()


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
    v = memoryview(value).cast("B") if not isinstance(value, memoryview) else value
    n = len(v)
    if n < REC_HEADER_BYTES:
        return Verified("corrupt")
    h = np.frombuffer(v[:REC_HEADER_BYTES], dtype=REC_DTYPE)[0]
    if crc32c(v[:252]) != int(h["header_crc"]) or bytes(h["magic"]) != REC_MAGIC \
            or int(h["version"]) != STORE_FORMAT_VERSION or int(h["header_bytes"]) != REC_HEADER_BYTES:
        return Verified("corrupt")
    T, K, P = int(h["token_count"]), int(h["key_bytes"]), int(h["payload_bytes"])
    po, rbytes, _ = record_geometry(T, K, P)
    if int(h["payload_offset"]) != po or int(h["record_bytes"]) != rbytes or n != rbytes:
        return Verified("corrupt")
    if crc32c(v[REC_HEADER_BYTES:]) != int(h["data_crc"]):
        return Verified("corrupt")
    found_key = bytes(v[REC_HEADER_BYTES + 4 * T: REC_HEADER_BYTES + 4 * T + K])
    if found_key != key:
        return Verified("foreign")  # another namespace, model or payload format
    toks = np.frombuffer(v[REC_HEADER_BYTES: REC_HEADER_BYTES + 4 * T], dtype="<u4")
    hb = int(h["hash_bytes"])
    same = (int(h["block_index"]) == block_index and hb == len(block_hash)
            and bytes(h["block_hash"])[:hb] == block_hash and bytes(h["parent_hash"])[:len(parent_hash)] == parent_hash
            and int(h["parent_id"]) == parent_chain
            and (payload_bytes is None or P == payload_bytes)
            and (chain_id is None or int(h["record_id"]) == chain_id)
            and (tokens is None or np.array_equal(toks, np.asarray(tokens, dtype="<u4").reshape(-1))))
    if not same:
        return Verified("collision")
    return Verified("ok", v[po: po + P], toks, int(h["created_ns"]), int(h["record_id"]))
