"""adopt() and the remote tier, against a real Redis on 127.0.0.1 holding the blocks: the
values the background writer puts for adopted pages (read from the pool in the writer
thread) are those it puts for the same blocks inserted from payloads, and the pages are
held until the writer read them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.remote.record import chain_ids, verify_record
from dsv41.config import ModelConfig

from ..remote_env import local_servers

B = 16
CONFIG = ModelConfig.preset("v41-tiny")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with local_servers(tmp_path_factory.mktemp("remote")) as s:
        yield s


def make_cache(s) -> PrefixCache:
    cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=0,
                     remote_blocks=s.snapshots_url, remote_lookup_timeout_s=1.0, remote_write_timeout_s=2.0)
    c = PrefixCache(CONFIG, cc, weights_id="adopt-remote-weights")
    assert c.remote.wait_connected(20.0)
    return c


def remote_blocks(c: PrefixCache, toks: np.ndarray, ns: str) -> list[tuple]:
    """(block index, payload, token ids, chain id) of every block's value in the store,
    each verified against the chain it must belong to."""
    key = c.key(ns)
    hashes = c.hasher.hash_blocks(toks, key)
    nb = len(hashes)
    tok = toks[: nb * B].reshape(nb, B)
    chain = chain_ids(tok, key)
    values = c.remote.blocks.call("get", 5.0, c.remote.block_keys(ns, hashes))
    out = []
    for i, v in enumerate(values):
        assert v is not None, f"block {i} was not written"
        ver = verify_record(v, key=key, block_index=i, block_hash=hashes[i],
                            parent_hash=hashes[i - 1] if i else c.hasher.root(key),
                            parent_chain=chain[i - 1] if i else 0, tokens=tok[i], payload_bytes=c.layout.block_bytes)
        assert ver.status == "ok", (i, ver.status)
        out.append((i, bytes(ver.payload), ver.chain_id))
    return out


def test_adopted_pages_reach_the_remote_store_as_inserted_blocks_do(servers):
    a, b = make_cache(servers), make_cache(servers)
    try:
        toks = np.random.default_rng(7).integers(0, 30000, 4 * B + 3).astype("<u4")
        want = torch.from_numpy(np.random.default_rng(8).integers(0, 256, (4, a.layout.block_bytes), dtype=np.uint8))
        a.release(a.insert(toks, want, "ins"))
        pages = b.pool.allocate(4)
        b.pool.write(pages, want)
        m = b.adopt(toks, pages, "ado")
        b.release(m)            # the writer's own hold keeps the pages until it read them
        assert a.remote.flush(20.0) and b.remote.flush(20.0)
        assert b.pool.stats()["referenced_blocks"] == 0
        got_a, got_b = remote_blocks(a, toks, "ins"), remote_blocks(b, toks, "ado")
        assert [(i, p) for i, p, _ in got_b] == [(i, p) for i, p, _ in got_a]
        assert [p for _, p, _ in got_b] == [bytes(r) for r in want.numpy()]
        for c in (a, b):
            assert c.metrics.to_dict()["dsv41_cache_remote_writes_total"] == {"role=blocks": 4}
        # The store already holds them: another server adopting the same blocks writes
        # nothing (the writer checks first) and never reads its pages.
        c = make_cache(servers)
        try:
            reads = []
            real = c.pool.read
            c.pool.read = lambda *args, **kw: reads.append(1) or real(*args, **kw)
            mine = c.pool.allocate(4)
            c.pool.write(mine, want)
            c.release(c.adopt(toks, mine, "ado"))
            assert c.remote.flush(20.0)
            assert c.metrics.to_dict()["dsv41_cache_remote_writes_total"].get("role=blocks", 0) == 0
            assert reads == [] and c.pool.stats()["referenced_blocks"] == 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()
