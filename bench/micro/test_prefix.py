"""Block hashing of a 64K-token prompt and prefix matching against a cached 64K prefix.

hash_blocks (the chain with the constant parts of each block's encoding built once)
beside the reference: block_hash() per block, the definition spelled out. The prefix
match (hash + pool walk + token comparison + pin, then release) beside its hashing alone,
so the ratio is what matching adds to hashing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache import BlockHasher, CacheConfig, PrefixCache
from dsv41.config import ModelConfig

TOKENS = 64 * 1024
BLOCK = 64


def _prompt() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 129_280, TOKENS).astype("<u4")


def _reference_chain(h: BlockHasher, tokens: np.ndarray, key: bytes) -> list[bytes]:
    out, prev = [], h.root(key)
    for i in range(tokens.size // h.block_tokens):
        prev = h.block_hash(prev, tokens[i * h.block_tokens:(i + 1) * h.block_tokens], key)
        out.append(prev)
    return out


@pytest.mark.parametrize("impl", ["hash_blocks", "reference"])
def test_block_hashing_64k(benchmark, impl):
    benchmark.group = "block-hashing-64k"
    h, tok, key = BlockHasher(BLOCK), _prompt(), b"namespace+model+format"
    assert h.hash_blocks(tok, key) == _reference_chain(h, tok, key)
    fn = h.hash_blocks if impl == "hash_blocks" else (lambda t, k: _reference_chain(h, t, k))
    hashes = benchmark(fn, tok, key)
    assert len(hashes) == TOKENS // BLOCK


@pytest.fixture(scope="module")
def cached_64k():
    config = ModelConfig.preset("v41-flash")
    cache = PrefixCache(config, CacheConfig(block_tokens=BLOCK, device="cpu",
                                            gpu_capacity_bytes=256 << 20, swa_capacity_bytes=0))
    tok = _prompt()
    nb = TOKENS // BLOCK
    payloads = torch.zeros(nb, cache.layout.block_bytes, dtype=torch.uint8)
    cache.release(cache.insert(tok, payloads))
    yield cache, tok
    cache.close()


@pytest.mark.parametrize("impl", ["match", "hash_only"])
def test_prefix_match_64k(benchmark, cached_64k, impl):
    benchmark.group = "prefix-match-64k"
    cache, tok = cached_64k
    key = cache.key()

    def match():
        m = cache.match(tok)
        cache.release(m)
        return m.cached_tokens

    def hash_only():
        return len(cache.hasher.hash_blocks(tok, key)) * BLOCK

    assert benchmark(match if impl == "match" else hash_only) == TOKENS
