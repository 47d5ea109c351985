"""The MoE router's score functions: V4's sqrtsoftplus and the sigmoid and softmax that
DeepSeek's reference also defines (transformers' DeepseekV4 has sqrtsoftplus and sigmoid;
the sigmoid model is checked against it in test_transformers_configs.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41 import Model, ModelConfig
from dsv41.model import production

SCORE = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid,
         "softmax": lambda z: z.softmax(-1)}


@pytest.mark.parametrize("func", sorted(SCORE))
def test_router_weights_follow_deepseeks_reference(func):
    """DeepSeek's reference Gate: the top-k of scores + bias; weights = the chosen
    unbiased scores, renormalized over the k unless the scores are a softmax, times
    route_scale."""
    cfg = ModelConfig.preset("v4-tiny").replace(scoring_func=func)
    gate = Model.synthetic(cfg, seed=3).layers[3].ffn.gate
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, weights = gate(x)
    scores = SCORE[func](x.double() @ gate.weight.double().T)
    want_ids = (scores + gate.bias.double()).topk(cfg.num_experts_per_tok, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    want = scores.gather(1, ids)
    if func != "softmax":
        want = want / want.sum(-1, keepdim=True)
    assert torch.allclose(weights, want * cfg.routed_scaling_factor, rtol=1e-6)
    # the production path's float32 router agrees
    p_ids, p_weights = production.gate_forward(gate, x, None)
    assert torch.equal(p_ids, ids)
    assert torch.allclose(p_weights.double(), weights, rtol=1e-5)
