"""bench/bench_copy.py's refcheck on a GPU: the round trip host -> device -> host with
pinned host pools on both ends (the first GPU run's refcheck passed an unpinned one)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.gpu
def test_refcheck_round_trip_is_bit_exact():
    import bench_copy

    assert bench_copy.refcheck() == {"bit_exact": True}
