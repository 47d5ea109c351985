"""Fallback schemas for the attention/indexer ops that have CUDA kernels in csrc/.

The model defines these ops (python/dsv41/ops/attention.py, torch.library.custom_op, with
the float64 reference as the default kernel) and csrc/bindings/kernels.cpp registers their
CUDA kernels. Where the model's definitions are absent (this branch before the model is
merged), the schemas below are defined here instead, matching the op contracts, so the
CUDA kernels are callable (there is then no CPU kernel: the reference lives with the model).
Imported after the model's ops module, this defines nothing once the model is present.
"""
from __future__ import annotations

import torch

SCHEMAS = {
    "sparse_attention": "sparse_attention(Tensor q, Tensor swa_values, Tensor swa_scales, Tensor swa_idx, "
                        "Tensor kv_codes, Tensor kv_scales, Tensor kv_idx, Tensor sink, float softmax_scale)"
                        " -> (Tensor, Tensor)",
    "indexer_scores": "indexer_scores(Tensor q_codes, Tensor q_scales, Tensor weights, Tensor k_codes, "
                      "Tensor k_scales) -> Tensor",
    "indexer_scores_at": "indexer_scores_at(Tensor q_codes, Tensor q_scales, Tensor weights, Tensor k_codes, "
                         "Tensor k_scales, Tensor idx) -> Tensor",
    "topk_visible": "topk_visible(Tensor scores, Tensor visible, int k) -> Tensor",
    "candidate_blocks": "candidate_blocks(Tensor scores, Tensor visible, int block, int n_blocks) -> Tensor",
}


def is_defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"dsv41::{name}", "")
        return True
    except RuntimeError:
        return False


_lib = None
DEFINED_HERE: list[str] = []


def _define_missing() -> None:
    global _lib
    missing = [n for n in SCHEMAS if not is_defined(n)]
    if not missing:
        return
    _lib = torch.library.Library("dsv41", "FRAGMENT")  # noqa: TOR901 (kept alive in a global)
    for name in missing:
        _lib.define(SCHEMAS[name])
        DEFINED_HERE.append(name)
    fakes = {
        "sparse_attention": lambda q, *a: (q.new_empty(q.shape), q.new_empty(q.shape[:2])),
        "indexer_scores": lambda qc, qs, w, kc, ks: w.new_empty((w.shape[0], kc.shape[0])),
        "indexer_scores_at": lambda qc, qs, w, kc, ks, idx: w.new_empty(idx.shape),
        "topk_visible": lambda s, v, k: s.new_empty((s.shape[0], k), dtype=torch.int32),
        "candidate_blocks": lambda s, v, b, n: s.new_empty((s.shape[0], n * b), dtype=torch.int32),
    }
    for name in missing:
        torch.library.register_fake(f"dsv41::{name}", fakes[name], lib=_lib)


_define_missing()
