"""PoolTier: the GPU pool (GlobalKVPool) as the first block tier, and the one place pages
enter a match: mapped on a hit, filled by a lower tier's load, written from an insert's
payloads, or adopted from a sequence's private pages."""
from __future__ import annotations

from typing import Sequence

import torch

from ..global_pool import GlobalKVPool
from ..match import PrefixMatch
from .base import BlockRows, BlockTier, HostRows

__all__ = ["PoolTier"]


class PoolTier(BlockTier):
    name = "gpu"

    def __init__(self, pool: GlobalKVPool):
        self.pool = pool

    def lookup(self, m: PrefixMatch, start: int = 0) -> int:
        return max(0, len(self.pool.match(m.key, m.hashes, m.token_rows())) - start)

    def load(self, m: PrefixMatch) -> int:
        """Maps the cached pages of m's chain into m (no copy), counting a hit on each."""
        if m.num_blocks:
            raise ValueError("the pool is the first tier: it loads into an empty match")
        pool = self.pool
        with pool.lock:
            bids = pool.match(m.key, m.hashes, m.token_rows())
            pool.acquire(bids)
            for b in bids:
                pool.slot(b).hits += 1
        m.block_ids.extend(bids)
        return len(bids)

    def put(self, m: PrefixMatch, start: int, rows: BlockRows | None) -> None:
        """insert(): new pages for blocks start.. from the caller's payloads, as many as the
        pool can hold (identical cached blocks are referenced instead)."""
        if rows is None:
            return
        if not isinstance(rows, HostRows):
            raise TypeError("PoolTier.put takes an insert's payloads; adopt() publishes pool pages")
        pool = self.pool
        nb = len(m.hashes)
        with pool.lock:
            new = pool.insert_many(m.key, m.block_ids[-1] if start else None, m.hashes[start:nb],
                                   m.token_rows(nb)[start:nb], start, rows.payloads)
        m.block_ids.extend(new)

    def evict(self) -> int:
        return self.pool.evict_all()

    # ---- what the tiers below and adopt() need ------------------------------------------

    def fill(self, m: PrefixMatch, rows: torch.Tensor, record_ids: Sequence[int] | None = None) -> int:
        """Extends m with blocks m.num_blocks.. whose verified payloads are `rows`: pages
        allocated (as many as the pool can free, the rest is dropped), written in one
        transfer outside the pool lock (nobody else can reach a private page), then
        published in chain order. An identical block another thread cached meanwhile is
        referenced instead and the page written for it freed. record_ids: each block's
        record in the persistent store (set where the page has none). Returns how many
        blocks m gained."""
        pool, g = self.pool, m.num_blocks
        with pool.lock:
            n = min(len(rows), pool.num_free())
            pages = pool.allocate(n)
        if not n:
            return 0
        try:
            pool.write(pages, rows[:n])
        except BaseException:
            pool.release(pages)
            raise
        tok = m.token_rows(g + n)
        with pool.lock:
            parent = m.block_ids[-1] if g else None
            for i, page in enumerate(pages):
                got = pool.publish(page, m.key, parent, m.hashes[g + i], tok[g + i], g + i)
                if got != page:
                    pool.release([page])
                if record_ids is not None:
                    s = pool.slot(got)
                    if s.record_id is None:
                        s.record_id = record_ids[i]
                m.block_ids.append(got)
                parent = got
        return n

    def adopt(self, m: PrefixMatch, page_ids: Sequence[int]) -> None:
        """Publishes the private pages page_ids as blocks m.num_blocks.. of m's chain and
        moves the caller's reference on each into m (see PrefixCache.adopt for the rule).
        Every page is checked before any is published, under one hold of the pool lock: on
        an error nothing has moved and the caller still owns its pages."""
        pool, g = self.pool, m.num_blocks
        pages = [int(p) for p in page_ids]
        tok = m.token_rows(g + len(pages))
        with pool.lock:
            if len(set(pages)) != len(pages):
                raise ValueError(f"adopt: page ids repeat: {pages}")
            for p in pages:
                try:
                    if not 0 <= p < pool.num_blocks:
                        raise KeyError(p)
                    s = pool.slot(p)
                except KeyError:
                    raise ValueError(f"adopt: page {p} is not an allocated page of this pool") from None
                if not s.private or s.refs < 1:
                    raise ValueError(f"adopt: page {p} is not a private page holding the caller's reference "
                                     "(GlobalKVPool.allocate gives those)")
            parent = m.block_ids[-1] if g else None
            if parent is not None:
                ps = pool.slot(parent)
                if ps.private or ps.hash is None:   # cannot happen while m references its chain
                    raise ValueError(f"adopt: the match's last page {parent} is no longer an indexed block")
            for i, page in enumerate(pages):
                got = pool.publish(page, m.key, parent, m.hashes[g + i], tok[g + i], g + i)
                if got != page:           # an identical block was cached: keep that one
                    pool.release([page])  # the caller's reference; a private page is then freed
                m.block_ids.append(got)
                parent = got
