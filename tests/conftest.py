import pytest
import torch

import dsv41  # noqa: F401  (fails loudly if the extension is missing)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def gen():
    """A seeded CPU generator: every test draws its own reproducible random data."""
    return torch.Generator().manual_seed(1234)
