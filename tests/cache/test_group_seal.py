"""A commit's segments are sealed as one group (writer.seal_segments, IOEngine.seal_files):
one engine call after the last segment's writes, segments published in order up to the
first failure, the ones before it durable and served, nothing left of the others."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dsv41.cache import io

from .helpers import B, LAYOUT, key, load_all, open_store, rand_tokens, write_chain

SEG = 4 * LAYOUT.block_bytes  # a few records per segment: a chain of 12 blocks is 3 or more segments


def _segments(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("seg-"))


def _put_chains(st, chains) -> list[list[int]]:
    return [write_chain(st, t, key(), commit=False)[1] for t in chains]


class _CountingEngine:
    """The store's engine, with its seal_files calls recorded."""

    def __init__(self, eng):
        self._eng, self.calls = eng, []

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def seal_files(self, files, durable, directory):
        self.calls.append(len(files))
        return self._eng.seal_files(files, durable, directory)


@pytest.mark.parametrize("durability", ["none", "fsync"])
def test_a_commit_of_several_segments_is_sealed_by_one_engine_call(tmp_path, durability):
    rng = np.random.default_rng(0)
    chains = [rand_tokens(rng, 12 * B) for _ in range(2)]
    eng = _CountingEngine(io.IOEngine(2))
    st = open_store(tmp_path, engine=eng, segment_bytes=SEG, durability=durability)
    rids = _put_chains(st, chains)
    res = st.commit()
    assert res.error is None and sorted(res.persisted) == sorted(r for c in rids for r in c)
    n_segs = len(_segments(tmp_path))
    assert n_segs >= 6 and eng.calls == [n_segs]
    st.close()
    st = open_store(tmp_path)
    for t, r in zip(chains, rids):
        assert load_all(st, t, key())[0] == r
    st.close()


def test_a_failure_inside_the_group_publishes_the_segments_before_it(tmp_path):
    rng = np.random.default_rng(1)
    chains = [rand_tokens(rng, 12 * B) for _ in range(2)]
    # The same commit in another directory, to learn the first segment's size (one writer
    # thread, so the engine's byte count follows the file order).
    dry = open_store(tmp_path / "dry", engine=io.IOEngine(2, write_depth=1), segment_bytes=SEG)
    _put_chains(dry, chains)
    dry.commit()
    first = os.path.getsize(tmp_path / "dry" / _segments(tmp_path / "dry")[0])
    dry.close()

    eng = io.IOEngine(2, write_depth=1)
    st = open_store(tmp_path / "s", engine=eng, segment_bytes=SEG)
    rids = _put_chains(st, chains)
    eng.set_faults(io.FAULT_NO_SPACE, nospace_after=first)  # the second segment's first write fails
    with pytest.warns(RuntimeWarning, match="not persisted"):
        res = st.commit()
    eng.set_faults(0)
    assert st.degraded and "no_space" in st.degraded_reason
    assert len(_segments(tmp_path / "s")) == 1
    assert not [n for n in os.listdir(tmp_path / "s") if n.startswith(".tmp-")]
    stored = load_all(st, chains[0], key())[0]
    assert stored and stored == rids[0][: len(stored)] and len(stored) < len(rids[0])
    assert sorted(res.persisted) == stored
    assert sorted(res.dropped) == sorted(set(r for c in rids for r in c) - set(stored))
    st.close()
    st = open_store(tmp_path / "s")  # what was published is durable and found again
    assert load_all(st, chains[0], key())[0] == stored and load_all(st, chains[1], key())[0] == []
    st.close()
