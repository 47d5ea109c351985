from __future__ import annotations

import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache
from dsv41.config import ModelConfig
from dsv41.model import Model

BLOCK = 16


@pytest.fixture(scope="session")
def tiny_model():
    return Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def make_cache(tiny_model, tmp_path):
    made = []

    def make(store: bool = False, ttl: float = 60.0):
        clock = Clock()
        cc = CacheConfig(block_tokens=BLOCK, device="cpu", gpu_capacity_bytes=1 << 24,
                         swa_capacity_bytes=1 << 26, swa_ttl_s=ttl,
                         store_dir=str(tmp_path / f"store{len(made)}") if store else None,
                         store_durability="none")
        cache = PrefixCache.for_model(tiny_model, cc, clock=clock)
        made.append(cache)
        return cache, clock

    yield make
    for c in made:
        c.close()


def tokens(seed: int, n: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
