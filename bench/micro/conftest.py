"""pytest-benchmark microbenchmarks of dsv41's hot CPU paths (docs/profiling.md).

Each benchmark sits in a group with its reference or baseline, measured in the same run,
so pytest-benchmark's table shows the ratio within the group; `--benchmark-compare`
against the committed baseline in bench/results/ shows a regression across commits.
Not collected by the test suite (testpaths = tests); tests/test_bench_micro.py runs every
benchmark once (--benchmark-disable) so they keep working.
"""
from __future__ import annotations

import pytest
import torch

import dsv41  # noqa: F401  (fails loudly if the extension is missing)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the numbers then do not depend on what else the machine runs
    on its other cores, and they match a serving process that pins its CPU work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
