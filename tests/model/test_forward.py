"""One-shot prefill, chunked prefill, token-by-token decode and batching all store the same
bytes and give the same logits (bit for bit), across block, window and top-k boundaries."""
from __future__ import annotations

import pytest
import torch

from dsv41 import kv_budget
from dsv41.model import state_bytes_equal, state_diff

from .conftest import token_ids

# v41-tiny: window 16, encoder ratio 2, top-k 8, candidate pool 4 blocks x 8 = 32 positions.
N = 70
CHECKPOINTS = (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 70)


@pytest.fixture(scope="module")
def decoded(tiny):
    """Token-by-token decode of N tokens: per-step logits and state clones at CHECKPOINTS."""
    ids = token_ids(N, seed=3)
    state = tiny.new_state()
    logits, clones = [], {}
    budget = kv_budget(tiny.config)
    for i, t in enumerate(ids.tolist()):
        logits.append(tiny.decode_step(t, state))
        assert state.nbytes() == {k: v for k, v in budget.bytes_for(i + 1).items()
                                  if k != "persistent"}
        if i + 1 in CHECKPOINTS:
            clones[i + 1] = state.clone()
    return ids, torch.stack(logits), clones


@pytest.mark.parametrize("n", CHECKPOINTS)
def test_one_shot_prefill_equals_token_by_token_decode(tiny, decoded, n):
    ids, logits, clones = decoded
    state = tiny.new_state()
    out = tiny.prefill(ids[:n], state, return_all_logits=True)
    assert out.shape == (n, tiny.config.vocab_size) and out.dtype == torch.float32
    assert torch.equal(out, logits[:n])
    assert state_diff(state, clones[n]) == []
    assert state.position == n and state.tokens == ids[:n].tolist()


@pytest.mark.parametrize("chunks", [(3, 5, 9, 1, 14, 38), (16, 16, 16, 16, 6), (33, 37),
                                    (1, 1, 2, 15, 17, 34), (69, 1)])
def test_chunked_prefill_equals_one_shot(tiny, decoded, chunks):
    ids, logits, clones = decoded
    state, outs, at = tiny.new_state(), [], 0
    for c in chunks:
        outs.append(tiny.prefill(ids[at:at + c], state, return_all_logits=True))
        # The default return is the last token's logits.
        assert torch.equal(outs[-1][-1], logits[at + c - 1])
        at += c
    assert torch.equal(torch.cat(outs), logits)
    assert state_bytes_equal(state, clones[N])


def test_appending_never_changes_earlier_logits_or_entries(tiny):
    ids = token_ids(50, seed=5)
    short, long = tiny.new_state(), tiny.new_state()
    a = tiny.prefill(ids[:23], short, return_all_logits=True)
    b = tiny.prefill(ids, long, return_all_logits=True)
    assert torch.equal(a, b[:23])
    for stores_a, stores_b in ((short.main_kv, long.main_kv), (short.index_keys, long.index_keys)):
        for layer, sa in stores_a.items():
            ca, sca = sa.committed()
            cb, scb = stores_b[layer].committed()
            assert 0 < ca.shape[0] < cb.shape[0]
            assert torch.equal(ca, cb[:ca.shape[0]])
            assert torch.equal(sca.view(torch.uint8), scb[:ca.shape[0]].view(torch.uint8))


def test_batched_calls_equal_running_each_sequence_alone(tiny, decoded):
    ids, logits, _ = decoded
    other = token_ids(40, seed=9)
    ref_other = tiny.prefill(other, tiny.new_state(), return_all_logits=True)
    s1, s2, s3 = tiny.new_state(), tiny.new_state(), tiny.new_state()
    tiny.prefill(ids[:11], s1)
    outs = tiny.prefill_batch([ids[11:47], other[:5], ids[:1]], [s1, s2, s3],
                              return_all_logits=True)
    assert torch.equal(outs[0], logits[11:47])
    assert torch.equal(outs[1], ref_other[:5])
    assert torch.equal(outs[2], logits[:1])
    last = tiny.prefill_batch([other[5:30], ids[1:3]], [s2, s3])
    assert torch.equal(last[0], ref_other[29]) and torch.equal(last[1], logits[2])
    dec = tiny.decode_batch(torch.tensor([int(ids[47]), int(other[30]), int(ids[3])]),
                            [s1, s2, s3])
    assert dec.shape == (3, tiny.config.vocab_size)
    assert torch.equal(dec[0], logits[47]) and torch.equal(dec[1], ref_other[30])
    assert torch.equal(dec[2], logits[3])
    alone = tiny.new_state()
    tiny.prefill(ids[:48], alone)
    assert state_bytes_equal(alone, s1)


def test_logits_are_a_real_distribution(tiny, decoded):
    _, logits, _ = decoded
    assert torch.isfinite(logits).all()
    # Different contexts give different predictions (the model is not degenerate).
    assert logits.std(0).mean() > 0.1
