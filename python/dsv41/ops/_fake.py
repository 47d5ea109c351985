"""Fake (meta) kernels: output shapes and dtypes only, for torch.compile and FakeTensor."""
from __future__ import annotations

import torch

from ..formats import layout


def _register(spec: layout.BlockFormat) -> None:
    name, per_code, block = spec.name, spec.values_per_code, spec.block
    code_dtype, scale_dtype = spec.code_dtype, spec.scale_dtype

    def quantize_fake(x):
        torch._check(x.shape[-1] % block == 0, lambda: f"quantize_{name}: last dim % {block} != 0")
        lead = x.shape[:-1]
        return (x.new_empty((*lead, x.shape[-1] // per_code), dtype=code_dtype),
                x.new_empty((*lead, x.shape[-1] // block), dtype=scale_dtype))

    def quantize_into_fake(x, codes, scales):
        return None

    def dequantize_fake(codes, scales):
        return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * per_code), dtype=torch.float32)

    torch.library.register_fake(f"dsv41::quantize_{name}")(quantize_fake)
    torch.library.register_fake(f"dsv41::quantize_{name}_into")(quantize_into_fake)
    torch.library.register_fake(f"dsv41::dequantize_{name}")(dequantize_fake)


for _spec in layout.BLOCK_FORMATS.values():
    _register(_spec)


def _register_fp8_v4() -> None:
    def quantize_fake(x, rope_dim, amax_floor):
        lay = layout.Fp8V4Layout(int(x.shape[-1]), rope_dim)
        return x.new_empty((*x.shape[:-1], lay.entry_bytes), dtype=torch.uint8)

    def quantize_into_fake(x, rope_dim, amax_floor, entries):
        return None

    def dequantize_fake(entries, head_dim, rope_dim):
        lay = layout.Fp8V4Layout(head_dim, rope_dim)
        torch._check(entries.shape[-1] == lay.entry_bytes,
                     lambda: f"dequantize_fp8_v4: entries need {lay.entry_bytes} bytes per row")
        return entries.new_empty((*entries.shape[:-1], head_dim), dtype=torch.float32)

    torch.library.register_fake("dsv41::quantize_fp8_v4")(quantize_fake)
    torch.library.register_fake("dsv41::quantize_fp8_v4_into")(quantize_into_fake)
    torch.library.register_fake("dsv41::dequantize_fp8_v4")(dequantize_fake)


_register_fp8_v4()


# ---- attention and indexer ops (defined in attention.py) ---------------------------------

def _register_attention_fakes() -> None:
    from . import _checks

    def attention_fake(dense):
        def fake(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_sel, sink,
                 softmax_scale):
            _checks.check_attention("dense_attention" if dense else "sparse_attention", q,
                                    swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                                    kv_sel, sink, dense=dense)
            T, H, D = q.shape
            # out in q's dtype (float32 or bfloat16), lse always float32 (reference.py)
            return q.new_empty((T, H, D)), q.new_empty((T, H), dtype=torch.float32)
        return fake

    def scores_fake(q_codes, q_scales, weights, k_codes, k_scales):
        _checks.check_indexer("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales)
        return weights.new_empty((weights.shape[0], k_codes.shape[0]))

    def scores_at_fake(q_codes, q_scales, weights, k_codes, k_scales, idx):
        _checks.check_indexer("indexer_scores_at", q_codes, q_scales, weights, k_codes,
                              k_scales, idx)
        return weights.new_empty(tuple(idx.shape))

    def topk_fake(scores, visible, k):
        _checks.check_selection("topk_visible", scores, visible, k)
        return scores.new_empty((scores.shape[0], k), dtype=torch.int32)

    def candidates_fake(scores, visible, block, n_blocks):
        _checks.check_selection("candidate_blocks", scores, visible, n_blocks, name="n_blocks")
        return scores.new_empty((scores.shape[0], n_blocks * block), dtype=torch.int32)

    torch.library.register_fake("dsv41::sparse_attention")(attention_fake(False))
    torch.library.register_fake("dsv41::dense_attention")(attention_fake(True))
    torch.library.register_fake("dsv41::indexer_scores")(scores_fake)
    torch.library.register_fake("dsv41::indexer_scores_at")(scores_at_fake)
    torch.library.register_fake("dsv41::topk_visible")(topk_fake)
    torch.library.register_fake("dsv41::candidate_blocks")(candidates_fake)


_register_attention_fakes()
