"""transformers' DeepSeek-V4 as an oracle: one random model factory for the tests and the
benchmark, and the query rows where a top-k tie lets two correct implementations differ.

`random_deepseek_v4(config, seed)` builds transformers' DeepseekV4ForCausalLM in float32
and draws every tensor (transformers initializes biases, sinks, position biases and the
hash tables to zero, which would hide mistakes): norm weights 1 + N(0, 0.1^2), the mHC
scales 1 + N(0, 0.2^2), matrices N(0, 1/fan_in), every other vector and the position biases
N(0, 0.3^2), the gates' correction bias N(0, 0.05^2), and each hash table k distinct random
experts per token id. transformers is imported only here (a test dependency).

Top-k ties: when the indexer's scores tie at the k-th place (often exactly 0: every head's
ReLU is 0), dsv41 keeps the lowest entry ids (deterministic and batch invariant,
docs/model.md) and transformers keeps whatever torch.topk returns. Both are correct, and
their logits differ at that row and, through its hidden state, at every later row of the
sequence. `tied_rows` finds such rows from a traced dsv41 forward in the float32 reference
mode, so a comparison can stop there and say so.
"""
from __future__ import annotations

import torch

__all__ = ["TIE_TOLERANCE", "random_deepseek_v4", "tied_rows"]

# Scores closer than this (relative to the row's largest |score|) count as tied: dsv41
# scores in float64, transformers in float32, so nearer ones may order either way.
TIE_TOLERANCE = 1e-5


@torch.no_grad()
def random_deepseek_v4(config, seed: int = 0):
    """transformers' DeepseekV4ForCausalLM for `config` (a DeepseekV4Config), float32, eval
    mode, every tensor drawn from a generator seeded by `seed` (module docstring)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)      # transformers' own init runs first; every tensor is redrawn
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("scale"):                     # mHC: attn_hc.scale, hc_head.hc_scale
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif p.dim() >= 2 and "position_bias" not in name:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        else:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], config.n_routed_experts, generator=g)
                    .argsort(-1)[:, :b.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def tied_rows(model, state, trace: dict) -> torch.Tensor:
    """Rows [T] (bool) of the call `trace` recorded whose top-k selection is tied in some
    indexed layer: more visible entries than index_topk, and the k-th and (k+1)-th best
    scores within TIE_TOLERANCE. model: a dsv41 Model with kv_dtype="float32" (its indexer
    queries and keys are the unquantized values the scores come from); state: the sequence
    state after that call; trace: the dict passed to its prefill."""
    if model.options.get("kv_dtype") != "float32":
        raise ValueError("tied_rows reads float32 indexer queries and keys: load the model "
                         "with kv_dtype='float32'")
    c = model.config
    tied = None
    for p in c.layer_plan():
        rec = trace.get(p.layer, {})
        if "index_w" not in rec:
            continue
        q, w = rec["index_q"][0].double(), rec["index_w"].double()            # [T,Hi,Di], [T,Hi]
        keys = state.index_keys[p.index_key_source].rows()[0].double()        # [N, Di]
        T = q.shape[0]
        if tied is None:
            tied = torch.zeros(T, dtype=torch.bool)
        positions = torch.arange(state.position - T, state.position)
        visible = (positions + 1) // p.compress_ratio
        scores = (torch.einsum("thd,nd->thn", q, keys).clamp(min=0) * w[..., None]).sum(1)
        k = c.index_topk
        for t in torch.nonzero(visible > k).flatten().tolist():
            row = scores[t, :int(visible[t])].sort(descending=True).values
            tol = TIE_TOLERANCE * float(row.abs().max())
            tied[t] |= bool(row[k - 1] - row[k] <= tol)
    return torch.zeros(0, dtype=torch.bool) if tied is None else tied
