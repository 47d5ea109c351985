"""SwaCheckpointStore: V4's SWA snapshots persisted on the SSD, beside the block store.

V4's overlapping compressor windows rule out encoder replay, so a V4 session whose host
SWA snapshot expired (swa_pool TTL) would recompute its window from the global KV. With
CacheConfig.swa_checkpoint_tokens = N the engine also writes the SWA state to disk every N
tokens and at the end of prompt and output (the "SWA checkpoints" of V4's system); a lookup
that finds no snapshot in the host pool (or the remote tier) loads the longest checkpoint
at or below the global-KV hit, so the session resumes exactly instead.

Format: one file per checkpoint in `<store_dir>/swa_checkpoints/`, holding one record in
the remote tier's format (cache/remote/record.py: the SSD store's 256-byte header with
header and data CRC-32C, the token ids, the cache key, then the payload), whose payload is
the snapshot encoded by cache/remote/snapshot_codec.py. So a checkpoint is verified exactly
like every other record: CRC ("corrupt"), cache key = namespace + model fingerprint +
payload format ("foreign"), then block index, block hash and every token id ("collision").
Only "ok" is served; any other status is a counted miss, and a corrupt file is removed. A
whole record of another session after the same full blocks (its tail tokens differ) is
skipped and kept.

A checkpoint after n tokens is named `<hash of block n//B - 1 (root for n < B)>-<n>-<hash of
its tail tokens>.swa`: a lookup probes the block boundaries of the hit, longest first, like
the host pool, and reads only files whose name matches its own prefix. The
block store (cache/store) stays unchanged: checkpoints are a sibling directory, not a new
record kind in its segments, so they neither count against nor disturb its chain GC.
Writes go to a temporary name then rename (fsync'd with durability "fsync"): a crash
leaves a whole checkpoint or none. Bytes written and bytes on disk are accounted
(stats(), and cache stats()["swa_checkpoints"]). Lifetime: a checkpoint older than ttl_s
(the store's TTL, from the time in its header) is removed when met; capacity_bytes (the
store's; None: unbounded) drops the oldest files first.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np

from .hashing import as_token_array
from .remote.record import encode_record, verify_record
from .remote.snapshot_codec import decode_snapshot, encode_snapshot
from .swa_pool import TensorSnapshot

__all__ = ["SwaCheckpointStore", "default_checkpoint_tokens"]

_SUFFIX = ".swa"


def default_checkpoint_tokens(config) -> int | None:
    """The per-model default, from the model config's own statement of its persistent
    cache (docs/config.md): `persistent_swa_interval_tokens` when `persistent_swa` (V4
    presets: 1024), else None (V4.1: bounded replay rebuilds the window, nothing persisted)."""
    if getattr(config, "persistent_swa", False) and getattr(config, "persistent_swa_interval_tokens", 0):
        return int(config.persistent_swa_interval_tokens)
    return None


class SwaCheckpointStore:
    def __init__(self, directory: str, block_tokens: int, *, durability: str = "fsync",
                 ttl_s: float | None = None, capacity_bytes: int | None = None,
                 clock: Callable[[], float] = time.time):
        if durability not in ("fsync", "none"):
            raise ValueError(f"durability must be 'fsync' or 'none', got {durability!r}")
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.block_tokens = block_tokens
        self.fsync = durability == "fsync"
        self.ttl_s, self.capacity_bytes, self.clock = ttl_s, capacity_bytes, clock
        self._lock = threading.Lock()
        self.counters = {"written": 0, "bytes_written": 0, "hits": 0, "misses": 0, "corrupt": 0,
                         "foreign": 0, "collision": 0, "other_tail": 0, "expired": 0, "evicted": 0}
        for name in os.listdir(directory):   # a crash leaves temporary files only: drop them
            if name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    def _name(self, block_hash: bytes, tokens: np.ndarray) -> str:
        """<block hash>-<tokens>-<16 hex of SHA-256 over the tail's token ids>.swa: sessions
        after the same full blocks (shared prefix) differ in their tails, so their
        checkpoints never overwrite each other's."""
        nb = tokens.size // self.block_tokens * self.block_tokens
        tail = hashlib.sha256(np.ascontiguousarray(tokens[nb:], dtype="<u4").tobytes()).hexdigest()[:16]
        return f"{block_hash.hex()}-{tokens.size}-{tail}{_SUFFIX}"

    def put(self, key: bytes, tokens, snapshot: TensorSnapshot, hashes: Sequence[bytes], root: bytes) -> int:
        """Writes the checkpoint of the state after exactly `tokens`; `hashes` are the chain
        hashes of its full blocks. Returns the bytes written."""
        arr = as_token_array(tokens)
        n = snapshot.num_tokens
        if arr.size != n:
            raise ValueError(f"checkpoint of {n} tokens given {arr.size} token ids")
        nb = n // self.block_tokens
        bh = hashes[nb - 1] if nb else root
        rec = encode_record(key=key, tokens=arr, payload=encode_snapshot(snapshot), block_index=nb,
                            block_hash=bh, parent_hash=root, chain_id=n, parent_chain=0,
                            created_ns=int(self.clock() * 1e9))
        path = os.path.join(self.dir, self._name(bh, arr))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(rec)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with self._lock:
            self.counters["written"] += 1
            self.counters["bytes_written"] += len(rec)
        if self.capacity_bytes is not None:
            self._evict()
        return len(rec)

    def get(self, key: bytes, tokens, hashes: Sequence[bytes], root: bytes, *, max_blocks: int,
            limit: int) -> TensorSnapshot | None:
        """The verified checkpoint of the longest prefix of `tokens` of at most `limit`
        tokens whose full blocks are all among the first `max_blocks` (the global-KV hit)."""
        arr = as_token_array(tokens)
        B = self.block_tokens
        now = self.clock()
        names = self._names()   # one directory listing per lookup
        for nb in range(min(max_blocks, limit // B, len(hashes)), -1, -1):
            bh = hashes[nb - 1] if nb else root
            prefix = bh.hex() + "-"
            cands = []
            for name in names:
                if name.startswith(prefix):
                    try:
                        n = int(name[len(prefix):].split("-", 1)[0])
                    except ValueError:
                        continue
                    if n // B == nb and n <= limit and name == self._name(bh, arr[:n]):
                        cands.append(n)   # the name's tail hash matches: only this prefix's
            for n in sorted(cands, reverse=True):
                snap = self._load(os.path.join(self.dir, self._name(bh, arr[:n])), key, arr[:n], nb, bh, root,
                                  now)
                if snap is not None:
                    with self._lock:
                        self.counters["hits"] += 1
                    return snap
        with self._lock:
            self.counters["misses"] += 1
        return None

    def _load(self, path: str, key: bytes, want: np.ndarray, nb: int, bh: bytes, root: bytes,
              now: float) -> TensorSnapshot | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        v = verify_record(data, key=key, block_index=nb, block_hash=bh, parent_hash=root, parent_chain=0,
                          chain_id=want.size)
        if v.status != "ok":
            self._drop(path, v.status)   # corrupt / foreign / collision: a miss, never served
            return None
        if not np.array_equal(v.tokens, want):
            # Another session's checkpoint after the same full blocks (its tail differs): a
            # valid record that is not this prefix - skipped, kept for its own session.
            with self._lock:
                self.counters["other_tail"] += 1
            return None
        if self.ttl_s is not None and now - v.created_ns / 1e9 > self.ttl_s:
            self._drop(path, "expired")
            return None
        try:
            snap = decode_snapshot(v.payload)
        except (ValueError, KeyError, TypeError):
            self._drop(path, "corrupt")
            return None
        return snap if snap.num_tokens == want.size else None

    def _drop(self, path: str, why: str) -> None:
        with self._lock:
            self.counters[why] = self.counters.get(why, 0) + 1
        if why in ("foreign", "collision"):
            return   # a whole record of another key or chain under a colliding name: keep it
        try:
            os.unlink(path)
        except OSError:
            pass

    def _names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.dir) if n.endswith(_SUFFIX)]
        except OSError:
            return []

    def _files(self) -> list[tuple[float, int, str]]:
        out = []
        for name in self._names():
            p = os.path.join(self.dir, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, p))
        return out

    def _evict(self) -> int:
        files = sorted(self._files())
        total = sum(s for _, s, _ in files)
        n = 0
        for _, size, p in files:
            if total <= self.capacity_bytes:
                break
            self._drop(p, "evicted")
            total -= size
            n += 1
        return n

    def trim(self) -> int:
        """Drops the oldest files until the directory fits capacity_bytes (put does after
        each write); returns how many. Expired checkpoints go when a lookup meets them."""
        return self._evict() if self.capacity_bytes is not None else 0

    @property
    def bytes_on_disk(self) -> int:
        return sum(s for _, s, _ in self._files())

    def stats(self) -> dict:
        files = self._files()
        with self._lock:
            out = dict(self.counters)
        out.update(files=len(files), bytes_on_disk=sum(s for _, s, _ in files), directory=self.dir)
        return out
