import pytest
import torch

from dsv41 import Model, ModelConfig


@pytest.fixture(scope="session")
def tiny_config():
    return ModelConfig.preset("v41-tiny")


@pytest.fixture(scope="session")
def tiny(tiny_config):
    """The shared v41-tiny model (seed 0). Tests must not modify its weights."""
    return Model.synthetic(tiny_config, seed=0)


def token_ids(n: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
