"""The tier protocol: PrefixCache asks every tier the same few questions, in order.

Block tiers hold global KV blocks, addressed by a match's chain (its cache key, and each
full block's chain hash and token ids). The GPU pool is the first; each tier below it
continues the chain where the tiers above stop and loads what it finds into the pool:

    lookup(m, start) -> int     how many blocks start, start+1, ... of m's chain the tier
                                holds by its own index: nothing is read, referenced,
                                promoted or counted, so load() may verify fewer
    load(m) -> int              extends m from m.num_blocks with the blocks the tier holds,
                                verified, as referenced pages of the pool (the pool maps its
                                own pages; a lower tier reads its blocks into new pages, one
                                transfer into the pool); returns how many
    put(m, start, rows)         offers the tier blocks [0, len(m.hashes)) of m's chain:
                                blocks start.. were just computed and `rows` holds their
                                payloads; rows None: m was just served by the tiers above,
                                and the tier takes what its admission policy admits
    evict() -> int              drops what the tier may drop now (unreferenced pages,
                                expired entries, what exceeds its budget); returns how many

Snapshot tiers hold SWA snapshots, each the exact state after one token prefix; the first
is the host pool and the lower ones (remote, SSD checkpoints) are promoted into it on a hit:

    load(m, limit) -> TensorSnapshot | None   the longest usable snapshot of m's tokens
                                (at most `limit` tokens, its full blocks all in m)
    put(key, namespace, tokens, snapshot, hashes)   stores the state after `tokens`
    evict() -> int

A snapshot tier has no lookup(): a snapshot is read whole in one call, and a probe that
did not read it would save nothing.

Each tier owns its state and reaches other objects only through their public methods.
`BlockRows` is how a put gets payloads: the caller's tensor (insert), or pool pages read
once, by whichever writer thread needs them first (adopt).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import torch

from ..match import PrefixMatch
from ..swa_pool import TensorSnapshot

__all__ = ["BlockTier", "SnapshotTier", "BlockRows", "HostRows", "PoolRows"]


class BlockTier(ABC):
    name: str   # its label in metrics (tier="...") and stats

    @abstractmethod
    def lookup(self, m: PrefixMatch, start: int) -> int: ...

    @abstractmethod
    def load(self, m: PrefixMatch) -> int: ...

    @abstractmethod
    def put(self, m: PrefixMatch, start: int, rows: BlockRows | None) -> None: ...

    @abstractmethod
    def evict(self) -> int: ...


class SnapshotTier(ABC):
    name: str

    @abstractmethod
    def load(self, m: PrefixMatch, limit: int) -> TensorSnapshot | None: ...

    @abstractmethod
    def put(self, key: bytes, namespace: str, tokens: np.ndarray, snapshot: TensorSnapshot,
            hashes: Sequence[bytes] | None) -> bool | int: ...

    @abstractmethod
    def evict(self) -> int: ...


class BlockRows(ABC):
    """Payloads of blocks start .. start + n - 1, as a put takes them. A tier that keeps
    them past its put() (a queue, a writer thread) calls hold() first and release() when
    it is done with them."""

    start: int
    n: int
    deferred: bool   # reading them is a device transfer, worth doing in a writer thread

    @abstractmethod
    def host(self, stable: bool = True) -> torch.Tensor:
        """The payloads in host memory, uint8 [n, block_bytes]; stable: a copy that the
        caller of insert/adopt can no longer change."""

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass


class HostRows(BlockRows):
    """The payload tensor a caller gave insert() (any device). The stable host copy is
    made once, on first need, and shared by every tier."""

    deferred = False

    def __init__(self, payloads: torch.Tensor, start: int):
        self.payloads, self.start, self.n = payloads, start, payloads.shape[0]
        self._lock = threading.Lock()
        self._stable: torch.Tensor | None = None

    def host(self, stable: bool = True) -> torch.Tensor:
        with self._lock:
            if self._stable is not None:
                return self._stable
            rows = self.payloads.cpu()
            if rows.data_ptr() == self.payloads.data_ptr():   # the caller's own host tensor
                if not stable:
                    return rows
                rows = rows.clone()
            self._stable = rows   # a copy: from the device, or the clone
            return rows


class PoolRows(BlockRows):
    """Payloads that live in pool pages (what adopt() publishes): the pages are read once,
    into host memory, by whichever holder asks first, normally a background writer. Until
    then this object holds one pool reference on each page, so a page can neither be
    evicted nor reused before it is read; the references go right after the read, or when
    the last holder releases without reading. The creator is the first holder."""

    deferred = True

    def __init__(self, pool, pages: Sequence[int], start: int):
        self.pool, self.pages, self.start, self.n = pool, list(pages), start, len(pages)
        self._lock = threading.Lock()
        pool.acquire(self.pages)
        self._pinned = True    # this object's page references are held
        self._holders = 1
        self._host: torch.Tensor | None = None

    def host(self, stable: bool = True) -> torch.Tensor:
        with self._lock:
            if self._host is None:
                if not self._pinned:
                    raise RuntimeError("PoolRows.host() after the last holder released the pages")
                self._host = self.pool.read(self.pages, device="cpu")
                self.pool.release(self.pages)
                self._pinned = False
            return self._host

    def hold(self) -> None:
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("PoolRows.hold() after the last holder released it")
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders:
                return
            if self._pinned:
                self.pool.release(self.pages)
                self._pinned = False
            self._host = None

    def __enter__(self) -> "PoolRows":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
