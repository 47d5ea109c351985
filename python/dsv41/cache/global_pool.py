"""GlobalKVPool: the KV memory of global KV and indexer keys, paged, shared by reference.

The pool is the one place global KV lives on the device: the attention and indexer ops read
its arrays directly, running sequences write their new entries into its pages in place, and
the prefix cache indexes the full pages so that every request with that prefix maps the
same memory. A page ("block") covers `layout.block_tokens` tokens; for each array of the
block layout (layer, kind: main codes and scales, indexer codes and scales) the pool holds
one contiguous tensor `arrays[(layer, kind)]` of `num_blocks * entries` rows, where page b
owns rows [b * entries, (b + 1) * entries) - so a page id is a row base in every array.

Pages are of two kinds:
  - private: allocated to one running sequence (`allocate`), written in place by its steps,
    unindexed; freed when released;
  - cached: indexed by (key, parent identity, chain hash, token ids). `insert`/`insert_many`
    write a payload into a new cached page; `publish` turns a full private page into a
    cached one without a copy (the prefix cache adopting what a prefill wrote).
A page is referenced while any sequence holds it and is never evicted then; unreferenced
cached pages stay in LRU order and are evicted when room is needed.

Identity, not hashes, links a page to its parent: each records the uid of the page before
it, so a match walks exact parent links, compares token ids at every step and the key at
the chain's first page. A hash collision (tested with a 1-byte hash) is a miss.

Outside the pool a block travels as one flat payload (`layout`, the store's and the remote
tier's format): `read` gathers a page's rows from every array into it, `write` scatters a
payload into the arrays.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from .errors import PayloadError, PoolFullError
from .layout import BlockLayout
from .metrics import CacheMetrics

__all__ = ["GlobalKVPool"]


class _Slot:
    """One page's bookkeeping. A private page has hash None and private True until
    `publish` indexes it; a cached page whose chain was evicted above it is orphaned
    (hash None, private False) and freed when its last reference goes."""

    __slots__ = ("uid", "hash", "parent", "parent_uid", "key", "tokens", "block_index", "refs",
                 "record_id", "hits", "children", "private")

    def __init__(self, uid, hash_, parent, parent_uid, key, tokens, block_index):
        self.uid, self.hash, self.parent, self.parent_uid = uid, hash_, parent, parent_uid
        self.key, self.tokens, self.block_index = key, tokens, block_index
        self.private = False
        self.refs = 0
        self.record_id: int | None = None  # this block's record in the persistent store
        self.hits = 0
        self.children: set[int] = set()


class GlobalKVPool:
    """`capacity_bytes` of blocks on `device` (default: cuda when available, else cpu)."""

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: str | torch.device | None = None,
                 metrics: CacheMetrics | None = None):
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.num_blocks = int(capacity_bytes) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds no block of {self.block_bytes} bytes")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # One allocation, carved array by array: array (layer, kind) is [num_blocks *
        # entries, width] rows of its dtype, page b owning rows [b * entries, (b+1) * entries).
        self._memory = torch.zeros(self.num_blocks * self.block_bytes, dtype=torch.uint8,
                                   device=self.device)
        self.arrays: dict[tuple[int, str], torch.Tensor] = {}
        self._array_bytes: list[tuple[int, int, torch.Tensor]] = []  # (offset, nbytes, [blocks, nbytes] uint8)
        at = 0
        for a in layout.arrays:
            n = self.num_blocks * a.nbytes
            raw = self._memory[at: at + n]
            self._array_bytes.append((a.offset, a.nbytes, raw.view(self.num_blocks, a.nbytes)))
            rows = raw.view(self.num_blocks * a.entries, a.width)
            self.arrays[(a.layer, a.kind)] = rows if a.dtype == torch.uint8 else rows.view(a.dtype)
            at += n
        self.metrics = metrics or CacheMetrics()
        self.lock = threading.RLock()
        self._slots: list[_Slot | None] = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self._index: dict[bytes, list[int]] = {}
        self._next_uid = 1
        self._update_gauges()

    # ---- queries ------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def num_free(self) -> int:
        """Blocks available to new inserts: free plus evictable."""
        with self.lock:
            return len(self._free) + len(self._lru)

    def num_cached(self) -> int:
        with self.lock:
            return self.num_blocks - len(self._free)

    def slot(self, bid: int) -> _Slot:
        s = self._slots[bid]
        if s is None:
            raise KeyError(f"block {bid} is free")
        return s

    def match(self, key: bytes, hashes: Sequence[bytes], token_blocks: np.ndarray) -> list[int]:
        """Block ids of the longest cached prefix: block i matches when its hash, its token
        ids, its parent (the block matched at i-1, by identity) and, for i = 0, its key are
        those of the request. Does not reference the blocks (see acquire)."""
        out: list[int] = []
        parent_uid = 0
        with self.lock:
            for i, h in enumerate(hashes):
                found = None
                for bid in self._index.get(h, ()):
                    s = self._slots[bid]
                    if s.parent_uid != parent_uid or (parent_uid == 0 and s.key != key):
                        continue
                    if not np.array_equal(s.tokens, token_blocks[i]):
                        self.metrics.collisions.inc(tier="gpu")
                        continue
                    found = bid
                    break
                if found is None:
                    break
                out.append(found)
                parent_uid = self._slots[found].uid
        return out

    # ---- references ---------------------------------------------------------------------

    def acquire(self, bids: Sequence[int]) -> None:
        with self.lock:
            for bid in bids:
                s = self.slot(bid)
                s.refs += 1
                self._lru.pop(bid, None)

    def release(self, bids: Sequence[int]) -> None:
        """Drops one reference from each block. Blocks that become unreferenced enter the
        LRU deepest first, so a sequence's tail is evicted before its shared head."""
        with self.lock:
            for bid in reversed(list(bids)):
                s = self.slot(bid)
                if s.refs <= 0:
                    raise RuntimeError(f"block {bid} released more often than acquired")
                s.refs -= 1
                if s.refs == 0:
                    if s.private:   # a sequence's own page, never indexed: just free it
                        self._free_slot(bid, None)
                    elif s.hash is None:  # orphaned while referenced: nothing can reach it
                        self._free_slot(bid, "orphan")
                    else:
                        self._lru[bid] = None
                        self._lru.move_to_end(bid)
            self._update_gauges()

    def touch(self, bids: Sequence[int]) -> None:
        """Marks unreferenced blocks as recently used (deepest first, as in release)."""
        with self.lock:
            for bid in reversed(list(bids)):
                if bid in self._lru:
                    self._lru.move_to_end(bid)

    # ---- inserting and evicting ---------------------------------------------------------

    def insert(self, key: bytes, parent: int | None, block_hash: bytes, tokens: np.ndarray,
               block_index: int, payload: torch.Tensor | None = None,
               record_id: int | None = None) -> int:
        """Adds one block below `parent` (a referenced block id, None for a chain's first
        block) and returns its id with one reference taken. An identical block already
        cached is referenced and returned instead (its payload is not rewritten). Raises
        PoolFullError when every block is referenced."""
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
        with self.lock:
            parent_uid = 0 if parent is None else self.slot(parent).uid
            for bid in self._index.get(block_hash, ()):
                s = self._slots[bid]
                if s.parent_uid == parent_uid and (parent_uid or s.key == key) \
                        and np.array_equal(s.tokens, tokens):
                    self.acquire([bid])
                    if record_id is not None and s.record_id is None:
                        s.record_id = record_id
                    return bid
            bid = self._allocate()
            s = _Slot(self._next_uid, block_hash, parent, parent_uid, key, tokens.copy(), block_index)
            self._next_uid += 1
            s.refs = 1
            s.record_id = record_id
            self._slots[bid] = s
            self._index.setdefault(block_hash, []).append(bid)
            if parent is not None:
                self._slots[parent].children.add(bid)
            if payload is not None:
                self.write([bid], payload.reshape(1, -1) if payload.dim() == 1 else payload)
            self.metrics.inserted_blocks.inc(tier="gpu")
            self._update_gauges()
            return bid

    def insert_many(self, key: bytes, parent: int | None, hashes: Sequence[bytes], token_blocks: np.ndarray,
                    start_index: int, payloads: torch.Tensor,
                    record_ids: Sequence[int | None] | None = None) -> list[int]:
        """Inserts a run of consecutive blocks (block i's parent is block i-1, the first one's
        `parent`), referencing each; copies the payloads of the new ones in one batch. Stops
        early, returning the blocks inserted so far, when the pool is full."""
        if payloads is None or payloads.shape[0] < len(hashes):
            raise PayloadError(f"insert_many needs a payload for each of its {len(hashes)} blocks")
        out: list[int] = []
        fresh: list[tuple[int, int]] = []  # (block id, payload row)
        with self.lock:
            for i, h in enumerate(hashes):
                before = self._next_uid
                try:
                    bid = self.insert(key, parent, h, token_blocks[i], start_index + i, None,
                                      None if record_ids is None else record_ids[i])
                except PoolFullError:
                    break
                if self._next_uid != before:
                    fresh.append((bid, i))
                out.append(bid)
                parent = bid
            if fresh:
                rows = [r for _, r in fresh]
                if rows == list(range(payloads.shape[0])):
                    src = payloads  # every row is new, in order: no gather copy
                else:  # advanced indexing, not index_select: see read()
                    src = payloads[torch.as_tensor(rows, dtype=torch.long, device=payloads.device)]
                self.write([b for b, _ in fresh], src)
        return out

    def allocate(self, n: int) -> list[int]:
        """n private pages for a running sequence to write in place, each with one
        reference (evicting unreferenced cached pages, oldest first, when the free list runs
        out). All or nothing: raises PoolFullError, taking none, when fewer than n pages
        can be had."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        with self.lock:
            if n > len(self._free) + len(self._lru):
                raise PoolFullError(f"GlobalKVPool: {n} pages asked, {len(self._free)} free and "
                                    f"{len(self._lru)} evictable of {self.num_blocks}")
            out = []
            for _ in range(n):
                bid = self._allocate()
                s = _Slot(self._next_uid, None, None, 0, None, None, None)
                self._next_uid += 1
                s.private, s.refs = True, 1
                self._slots[bid] = s
                out.append(bid)
            self._update_gauges()
            return out

    def publish(self, bid: int, key: bytes, parent: int | None, block_hash: bytes,
                tokens: np.ndarray, block_index: int) -> int:
        """Indexes the full private page `bid` (its rows already written) as the block after
        `parent` (a cached page, None for a chain's first block), keeping the caller's
        reference: no payload moves. When an identical block is cached already, the pool
        keeps that one: it returns its id with a reference taken, and the caller releases
        `bid` and reads the returned page from now on. Otherwise returns `bid`."""
        tokens = np.ascontiguousarray(tokens, dtype="<u4")
        with self.lock:
            s = self.slot(bid)
            if not s.private:
                raise ValueError(f"publish: page {bid} is not a private page")
            if s.refs < 1:
                raise RuntimeError(f"publish: page {bid} holds no reference")
            parent_uid = 0
            if parent is not None:
                ps = self.slot(parent)
                if ps.private or ps.hash is None:
                    raise ValueError(f"publish: parent page {parent} is not an indexed block")
                parent_uid = ps.uid
            for other in self._index.get(block_hash, ()):
                o = self._slots[other]
                if o.parent_uid == parent_uid and (parent_uid or o.key == key) \
                        and np.array_equal(o.tokens, tokens):
                    self.acquire([other])
                    return other
            s.private = False
            s.hash, s.parent, s.parent_uid, s.key = block_hash, parent, parent_uid, key
            s.tokens, s.block_index = tokens.copy(), block_index
            self._index.setdefault(block_hash, []).append(bid)
            if parent is not None:
                self._slots[parent].children.add(bid)
            self.metrics.inserted_blocks.inc(tier="gpu")
            self._update_gauges()
            return bid

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._lru:
            raise PoolFullError(f"GlobalKVPool: all {self.num_blocks} blocks are referenced")
        victim = next(iter(self._lru))
        self._evict(victim, "capacity")
        return self._free.pop()

    def _evict(self, bid: int, cause: str) -> None:
        """Frees an unreferenced block; its descendants can no longer be matched, so the
        unreferenced ones are freed too and referenced ones are orphaned."""
        stack = [(bid, cause)]
        while stack:
            b, c = stack.pop()
            s = self._slots[b]
            if s is None:
                continue
            for child in list(s.children):
                cs = self._slots[child]
                if cs is None:
                    continue
                if cs.refs == 0:
                    stack.append((child, "orphan"))
                else:
                    self._unindex(child)
            if s.refs == 0:
                self._free_slot(b, c)
            else:
                self._unindex(b)

    def _unindex(self, bid: int) -> None:
        s = self._slots[bid]
        if s.hash is None:
            return
        lst = self._index.get(s.hash)
        if lst is not None:
            if bid in lst:
                lst.remove(bid)
            if not lst:
                del self._index[s.hash]
        s.hash = None

    def _free_slot(self, bid: int, cause: str | None) -> None:
        s = self._slots[bid]
        self._unindex(bid)
        if s.parent is not None:
            ps = self._slots[s.parent]
            if ps is not None and ps.uid == s.parent_uid:
                ps.children.discard(bid)
        self._lru.pop(bid, None)
        self._slots[bid] = None
        self._free.append(bid)
        if cause is not None:
            self.metrics.evictions.inc(tier="gpu", cause=cause)

    def evict_all(self) -> int:
        """Frees every unreferenced block (e.g. to test the SSD tier); returns how many."""
        with self.lock:
            n = 0
            while self._lru:
                before = len(self._free)
                self._evict(next(iter(self._lru)), "explicit")
                n += len(self._free) - before
            self._update_gauges()
            return n

    # ---- payload I/O --------------------------------------------------------------------

    def array(self, layer: int, kind: str) -> torch.Tensor:
        """The rows of one (layer, kind) array of every page: [num_blocks * entries, width]."""
        try:
            return self.arrays[(layer, kind)]
        except KeyError:
            raise KeyError(f"layer {layer} has no {kind!r} array in this pool "
                           f"(layers {self.layout.layers})") from None

    def entries_per_block(self, layer: int) -> int:
        """Rows each page holds in `layer`'s arrays (block_tokens / its compress ratio)."""
        return self.layout.array(layer, "main_codes").entries

    def write(self, bids: Sequence[int], payloads: torch.Tensor) -> None:
        """Scatters flat payloads (uint8 [n, block_bytes], the layout's bytes, on any device)
        into pages bids[i] of every array. From host memory to a CUDA pool the payloads
        cross once (pinned memory directly, pageable through torch's staging) and are
        scattered on the device."""
        payloads = self.layout.check_blocks(payloads, "payloads")
        if payloads.shape[0] != len(bids):
            raise PayloadError(f"{payloads.shape[0]} payloads for {len(bids)} blocks")
        if not len(bids):
            return
        src = payloads.to(self.device, non_blocking=payloads.is_pinned())
        idx = torch.as_tensor(list(bids), dtype=torch.long).to(self.device)
        for offset, nbytes, dst in self._array_bytes:
            dst.index_copy_(0, idx, src[:, offset: offset + nbytes])
        if src is not payloads and payloads.is_pinned():
            # the caller may reuse its pinned buffer as soon as this returns
            torch.cuda.current_stream(self.device).synchronize()

    def read(self, bids: Sequence[int], device: str | torch.device | None = None) -> torch.Tensor:
        """A copy of the pages as flat payloads, uint8 [n, block_bytes] on `device` (default
        the pool's): gathered from every array on the pool's device, then moved once (to
        pinned host memory when the pool is on a GPU and `device` is the CPU)."""
        out = torch.empty((len(bids), self.block_bytes), dtype=torch.uint8, device=self.device)
        if len(bids):
            idx = torch.as_tensor(list(bids), dtype=torch.long).to(self.device)
            for offset, nbytes, src in self._array_bytes:
                # advanced indexing, not index_select: on the CPU, torch's index_select of
                # uint8 rows takes a far slower path (seen with torch 2.14)
                out[:, offset: offset + nbytes] = src[idx]
        if device is None or torch.device(device) == self.device:
            return out
        if self.device.type == "cuda" and torch.device(device).type == "cpu":
            host = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(out)
            return host
        return out.to(device)

    def _update_gauges(self) -> None:
        cached = self.num_blocks - len(self._free)
        self.metrics.entries.set(cached, tier="gpu")
        self.metrics.bytes.set(cached * self.block_bytes, tier="gpu")

    def stats(self) -> dict:
        with self.lock:
            referenced = sum(1 for s in self._slots if s is not None and s.refs > 0)
            private = sum(1 for s in self._slots if s is not None and s.private)
            return {"device": str(self.device), "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
                    "capacity_bytes": self.capacity_bytes, "cached_blocks": self.num_blocks - len(self._free),
                    "referenced_blocks": referenced, "private_blocks": private,
                    "evictable_blocks": len(self._lru),
                    "free_blocks": len(self._free)}
