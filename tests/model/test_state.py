"""SequenceState: stored bytes equal the KV budget; clones; the prefix-cache and replay hooks."""
from __future__ import annotations

import pytest
import torch

from dsv41 import kv_budget
from dsv41.model import state_bytes_equal, state_diff

from .conftest import token_ids


@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 17, 40, 41])
def test_nbytes_equal_the_budget(tiny, n):
    state = tiny.new_state()
    if n:
        tiny.prefill(token_ids(n, seed=41), state)
    want = kv_budget(tiny.config).bytes_for(n)
    assert state.nbytes() == {k: want[k] for k in ("main", "indexer", "global", "swa",
                                                   "compressor_state")}
    state.check_budget()
    # And the bytes are really there: entry counts and formats.
    for layer, store in state.main_kv.items():
        m = tiny.config.compress_ratios[layer]
        codes, scales = store.committed()
        assert codes.shape == (n // m, tiny.config.head_dim // 2) and codes.dtype == torch.uint8
        assert scales.dtype == torch.float8_e4m3fn
    for layer, (kv, score) in state.pending.items():
        assert kv.shape == score.shape == (n % 2, tiny.config.head_dim)


def test_clone_is_independent(tiny):
    state = tiny.new_state()
    tiny.prefill(token_ids(19, seed=42), state)
    copy = state.clone()
    assert state_bytes_equal(state, copy)
    tiny.decode_step(3, copy)
    assert not state_bytes_equal(state, copy)
    assert state.position == 19 and copy.position == 20
    other = state.clone()
    other.main_kv[4].codes[0] ^= 1
    assert state_diff(state, other) == ["main_kv[4]"]


def test_export_import_and_swa_snapshot_rebuild_the_state(tiny):
    ids = token_ids(37, seed=43)
    live = tiny.new_state()
    tiny.prefill(ids, live)
    assert live.pending[2][0].shape[0] == 1  # odd length: a partial block is pending
    prefix = live.export_global(0, 36)
    snap = live.snapshot_swa()
    assert snap.aligned_to == 36 and snap.nbytes() > 0
    rebuilt = tiny.new_state()
    rebuilt.import_global(0, prefix)
    rebuilt.restore_swa(snap)
    assert state_bytes_equal(rebuilt, live)
    assert torch.equal(tiny.decode_step(9, rebuilt), tiny.decode_step(9, live))
    # Ranges must be aligned to every ratio, imports must extend exactly.
    with pytest.raises(ValueError, match="aligned to 2"):
        live.export_global(0, 35)
    with pytest.raises(ValueError, match="holds 0 entries"):
        tiny.new_state().import_global(2, prefix)
    with pytest.raises(ValueError, match="snapshot expects"):
        tiny.new_state().restore_swa(snap)


def test_rowstore_decoded_copy_follows_every_write():
    from dsv41.model import RowStore
    calls = []

    def dec(codes, scales):
        calls.append(codes.shape[0])
        return codes.float() * scales.float()

    store = RowStore(3, torch.uint8, 1, torch.uint8)
    assert store.decoded("x", dec).shape == (0, 3)

    def fresh():
        codes, scales = store.rows()
        return codes.float() * scales.float()

    store.stage(torch.arange(6, dtype=torch.uint8).view(2, 3), torch.full((2, 1), 2, dtype=torch.uint8))
    store.commit()
    calls.clear()
    assert torch.equal(store.decoded("x", dec), fresh()) and calls == [2]
    assert torch.equal(store.decoded("x", dec), fresh()) and calls == [2]   # nothing new
    for step in range(20):     # staged rows are decoded; a rollback rewrites them
        store.stage(torch.full((1, 3), step, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.uint8))
        assert torch.equal(store.decoded("x", dec), fresh())
        if step % 3 == 0:
            store.rollback()
            assert torch.equal(store.decoded("x", dec), fresh())
        else:
            store.commit()
    assert max(calls[1:]) == 1                  # one new row at a time
    store.truncate(4)
    store.stage(torch.full((2, 3), 99, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.uint8))
    assert torch.equal(store.decoded("x", dec), fresh()) and calls[-1] == 2
    assert store.clone().decoded("x", dec).shape == (4, 3)   # a clone starts without a copy


@pytest.mark.parametrize("preset", ["v4-tiny", "v41-tiny"])
def test_decode_with_decoded_copies_equals_decode_from_scratch(preset):
    """A CPU decode step reads RowStore.decoded's incremental copies (indexer keys, main KV);
    a clone starts without them and decodes every row: same logits, bit for bit."""
    from dsv41 import Model, ModelConfig
    model = Model.synthetic(ModelConfig.preset(preset), seed=0, precision="bf16")
    state = model.new_state()
    model.prefill(token_ids(45, seed=44), state)
    for t in range(9):
        scratch = state.clone()
        assert torch.equal(model.decode_step(t, state), model.decode_step(t, scratch))
        assert state_bytes_equal(state, scratch)
