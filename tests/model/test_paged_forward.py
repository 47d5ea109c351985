"""The paged step against the per-sequence model (SequenceState), the oracle.

In reference precision the pages, rings and compressor state must hold the same bytes as
the per-sequence state, and the logits must be the same values, whatever the chunking, the
mix of sequences in a step, the prefix a sequence shares, a replay's bounds, the padding of
a decode bucket, or the slot's previous occupant."""
from __future__ import annotations

import pytest
import torch

from dsv41.model import Extend
from dsv41.model.paged import SeqChunk, build_batch

from .conftest import token_ids
from .paged_helpers import Driver, assert_state_equal


def _ids(n: int, seed: int) -> list[int]:
    return token_ids(n, seed).tolist()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"logits differ by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("chunks", [[70], [1, 69], [16, 16, 38], [5, 7, 11, 13, 34], [33, 37]])
def test_chunked_prefill_then_decode_equals_one_shot(tiny, chunks):
    ids = _ids(sum(chunks), 1)
    st = tiny.new_state()
    ref = tiny.prefill(ids, st)
    drv = Driver(tiny)
    s = drv.new()
    at = 0
    for n in chunks:
        out = drv.step([(s, ids[at:at + n])])[0]
        at += n
    _same(out, ref)
    assert_state_equal(drv, s, st)
    for t in range(1, 9):                     # crosses a ratio-2 block and a page boundary
        _same(drv.step([(s, [t])])[0], tiny.decode_step(t, st))
    assert_state_equal(drv, s, st)


def test_ragged_batch_of_prefills_and_decodes_equals_each_alone(tiny):
    drv = Driver(tiny)
    lens = [3, 40, 17, 1, 64]
    seqs = [drv.new() for _ in lens]
    states = [tiny.new_state() for _ in lens]
    prompts = [_ids(n, 10 + i) for i, n in enumerate(lens)]
    # seqs 0 and 3 start earlier: the step mixes their decodes with the others' prefills
    for i in (0, 3):
        tiny.prefill(prompts[i], states[i])
        drv.step([(seqs[i], prompts[i])])
    work = [(seqs[0], [5]), (seqs[1], prompts[1]), (seqs[2], prompts[2]), (seqs[3], [7]),
            (seqs[4], prompts[4])]
    outs = drv.step(work)
    refs = [tiny.decode_step(5, states[0]), tiny.prefill(prompts[1], states[1]),
            tiny.prefill(prompts[2], states[2]), tiny.decode_step(7, states[3]),
            tiny.prefill(prompts[4], states[4])]
    for o, r in zip(outs, refs):
        _same(o, r)
    for s, st in zip(seqs, states):
        assert_state_equal(drv, s, st)
    for t in range(3):                        # decode-only steps of the whole batch
        outs = drv.step([(s, [t + 11]) for s in seqs])
        for o, st in zip(outs, states):
            _same(o, tiny.decode_step(t + 11, st))
    for s, st in zip(seqs, states):
        assert_state_equal(drv, s, st)


def test_all_logits_equal_return_all_logits(tiny):
    ids = _ids(37, 3)
    ref = tiny.prefill(ids, tiny.new_state(), return_all_logits=True)
    drv = Driver(tiny)
    s = drv.new()
    a = drv.step([(s, ids[:20])], all_logits=[True])[0]
    b = drv.step([(s, ids[20:])], all_logits=[True])[0]
    _same(torch.cat((a, b)), ref)


def test_a_prefix_hit_maps_the_pages_and_continues_exactly(tiny):
    """Sequence B maps A's first two full pages (no copy) and prefills only its suffix;
    its logits and state equal B's own full prefill."""
    drv = Driver(tiny)
    shared = _ids(32, 4)
    a_ids, b_ids = shared + _ids(21, 5), shared + _ids(30, 6)
    a = drv.new()
    drv.step([(a, a_ids)])
    b = drv.new()
    b.pages = a.pages[:2]
    drv.pool.acquire(b.pages)                 # the hit holds references, like a match
    b.position, b.tokens = 0, []
    # B's SWA and compressor state are rebuilt by the exact replay (from H - L_enc (W - 1),
    # here 0) over the cached global KV of the shared pages, which is read, not recomputed
    out = drv.step([(b, b_ids)], cached_until=[32])[0]
    st = tiny.new_state()
    ref = tiny.prefill(b_ids, st)
    _same(out, ref)
    assert b.pages[:2] == a.pages[:2] and drv.pool.slot(a.pages[0]).refs == 2
    assert_state_equal(drv, b, st)


@pytest.mark.parametrize("H, cut", [(32, 16), (48, 40), (64, 50)])
def test_bounded_encoder_replay_equals_the_reference_replay(tiny, H, cut):
    """Replay from `cut` over cached global KV up to H, against extend_batch on a state
    prepared by import_global + seek_for_replay."""
    ids = _ids(90, 7)
    full = tiny.new_state()
    tiny.prefill(ids[:H], full)
    st = tiny.new_state()
    st.import_global(0, full.export_global(0, H))
    st.seek_for_replay(ids[:cut])
    ref = tiny.extend_batch([Extend(ids[cut:], st, swa_start=cut, cached_until=H)])[0]
    drv = Driver(tiny)
    src = drv.new()
    drv.step([(src, ids[:H])])
    s = drv.new()
    s.pages = src.pages[:H // drv.P]
    drv.pool.acquire(s.pages)
    s.position, s.tokens = cut, ids[:cut]
    out = drv.step([(s, ids[cut:])], swa_start=[cut], cached_until=[H])[0]
    _same(out, ref)
    assert_state_equal(drv, s, st)
    _same(drv.step([(s, [9])])[0], tiny.decode_step(9, st))


def test_decoder_replay_equals_the_reference(tiny):
    ids = _ids(75, 8)
    W = tiny.config.sliding_window
    d = len(ids) - W
    st = tiny.new_state()
    ref = tiny.extend_batch([Extend(ids, st, decoder_start=d)])[0]
    drv = Driver(tiny)
    s = drv.new()
    out = drv.step([(s, ids)], decoder_start=[d], decoder_swa_start=[d])[0]
    _same(out, ref)
    for t in range(4):
        _same(drv.step([(s, [t])])[0], tiny.decode_step(t, st))


def test_decoder_replay_in_chunks_and_in_a_mixed_batch(tiny):
    ids = _ids(75, 8)
    W = tiny.config.sliding_window
    d = len(ids) - W
    st = tiny.new_state()
    ref = tiny.extend_batch([Extend(ids, st, decoder_start=d)])[0]
    other_ids = _ids(30, 9)
    other_st = tiny.new_state()
    other_ref = tiny.prefill(other_ids, other_st)
    drv = Driver(tiny)
    s, o = drv.new(), drv.new()
    # chunk 1 ends before d (no decoder rows, no logits); chunk 2 holds d, beside a plain prefill
    drv.step([(s, ids[:40])], decoder_start=[d], decoder_swa_start=[d], logits=[False])
    out = drv.step([(s, ids[40:]), (o, other_ids)], decoder_start=[d, None],
                   decoder_swa_start=[d, None])
    _same(out[0], ref)
    _same(out[1], other_ref)
    _same(drv.step([(s, [3])])[0], tiny.decode_step(3, st))


def test_padded_decode_bucket_and_context_cap_change_nothing(tiny):
    drv = Driver(tiny)
    seqs = [drv.new() for _ in range(3)]
    states = [tiny.new_state() for _ in range(3)]
    for i, (s, st) in enumerate(zip(seqs, states)):
        p = _ids(20 + 9 * i, 20 + i)
        drv.step([(s, p)])
        tiny.prefill(p, st)
    for t in range(6):
        outs = drv.step([(s, [t]) for s in seqs], pad_to=4, context_cap=128)
        for o, st in zip(outs, states):
            _same(o, tiny.decode_step(t, st))
    for s, st in zip(seqs, states):
        assert_state_equal(drv, s, st)


def test_a_reused_slot_and_pages_carry_nothing_over(tiny):
    drv = Driver(tiny, slots=1, pages=12)
    first = drv.new()
    drv.step([(first, _ids(90, 30))])
    drv.free(first)
    s = drv.new()
    assert s.slot == first.slot
    ids = _ids(45, 31)
    st = tiny.new_state()
    _same(drv.step([(s, ids)])[0], tiny.prefill(ids, st))
    assert_state_equal(drv, s, st)


def test_the_batch_builder_refuses_bad_chunks(tiny):
    kw = dict(window=16, page_tokens=16, ratios=(2, 1), num_slots=3)
    with pytest.raises(ValueError, match="no segments"):
        build_batch([], **kw)
    with pytest.raises(ValueError, match="do not cover"):
        build_batch([SeqChunk([1] * 20, 0, 0, [0])], **kw)
    with pytest.raises(ValueError, match="swa_start"):
        build_batch([SeqChunk([1], 4, 0, [0], swa_start=5)], **kw)
    with pytest.raises(ValueError, match="cached_until"):
        build_batch([SeqChunk([1], 4, 0, [0], cached_until=3)], **kw)
    with pytest.raises(ValueError, match="slot"):
        build_batch([SeqChunk([1], 0, 3, [0])], **kw)
    with pytest.raises(ValueError, match="bucket"):
        build_batch([SeqChunk([1], 0, 0, [0])] * 3, pad_to=2, pad_slot=2, **kw)
    with pytest.raises(ValueError, match="multiple of compress ratio"):
        build_batch([SeqChunk([1], 0, 0, [0])], window=16, page_tokens=15, ratios=(2,),
                    num_slots=3)


def test_paged_snapshots_equal_the_reference_snapshots_and_resume_exactly(tiny):
    """PagedMemory.snapshot writes the SWA tier's format of SequenceState.snapshot_swa byte
    for byte, and a sequence restored from it (on the cached pages of its aligned prefix)
    continues exactly like the per-sequence state it came from."""
    from dsv41.cache.global_pool import GlobalKVPool
    from dsv41.engine.cache_adapter import snapshot_boundary, snapshot_to_cache
    from dsv41.engine.paged_kv import PagedMemory
    drv = Driver(tiny)
    mem = PagedMemory(tiny, drv.pool, max_seqs=3, max_step_tokens=256)
    assert isinstance(mem.pool, GlobalKVPool)
    ids = _ids(53, 40)
    st = tiny.new_state()
    tiny.prefill(ids, st)
    from dsv41.model.paged import build_batch
    kv = mem.open()
    mem.ensure(kv, len(ids))
    batch = build_batch([SeqChunk(ids, 0, kv.slot, kv.pages)], window=tiny.config.sliding_window,
                        page_tokens=mem.page_tokens, ratios=mem.ratios,
                        num_slots=mem.kv.num_slots)
    from dsv41.model.paged import forward
    forward(tiny, batch, mem.kv)
    kv.position, kv.tokens = len(ids), list(ids)
    got = mem.snapshot(kv)
    want = snapshot_to_cache(st.snapshot_swa(snapshot_boundary(drv.layout, st.position)))
    assert got.num_tokens == want.num_tokens and got.meta == want.meta
    assert set(got.tensors) == set(want.tensors)
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
    # resume on a fresh sequence: the full pages mapped (as a cache hit would), the tail restored
    other = mem.open()
    full = len(ids) // mem.page_tokens
    other.map_pages(kv.pages[:full])
    drv.pool.acquire(other.pages)
    mem.restore(other, got)
    assert other.position == len(ids) and other.tokens == ids and len(other.pages) == full + 1
    for t in (5, 6, 7):
        mem.ensure(other, other.position + 1)
        b = build_batch([SeqChunk([t], other.position, other.slot, other.pages)],
                        window=tiny.config.sliding_window, page_tokens=mem.page_tokens,
                        ratios=mem.ratios, num_slots=mem.kv.num_slots)
        _same(forward(tiny, b, mem.kv)[0], tiny.decode_step(t, st))
        other.position += 1
        other.tokens.append(t)
    drv.pool.release(other.pages[:full])
    mem.close(other)
    mem.close(kv)
    assert mem.free_slots == 3
