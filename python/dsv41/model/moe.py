"""Mixture of experts: routed experts chosen by a gate, plus shared experts.

Gate: scores = score_func(W_g x), V4's sqrt(softplus(.)) or the sigmoid / softmax that
DeepSeek's reference also defines; the experts with the best scores + bias are chosen (the
bias only steers the choice, as in DeepSeek-V3's noaux routing; ties go to the lower expert
id); their unbiased scores are normalized to sum to 1 (not for softmax, whose scores already
do over all experts: DeepSeek's reference) and scaled by routed_scaling_factor. Experts are SwiGLU MLPs w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))
with L = swiglu_limit. The shared expert (n_shared_experts of them fused into one MLP of
n_shared * moe_intermediate_size) sees every token.

Hash layers (V4's first num_hash_layers layers): the experts are a frozen function of the
token id, `tid2eid[token]` (int64 [vocab, k], in that order); the scores still weight
them (normalized, scaled); there is no bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import gemm, production
from .layers import Linear, as_f64

__all__ = ["Expert", "Gate", "MoE"]


class Gate(nn.Module):
    def __init__(self, config: ModelConfig, *, hashed: bool = False):
        super().__init__()
        c = config
        self.topk, self.route_scale = c.num_experts_per_tok, c.routed_scaling_factor
        self.n_experts, self.score_func = c.n_routed_experts, c.scoring_func
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size),
                                   requires_grad=False)
        if hashed:
            self.register_buffer("tid2eid", torch.empty(c.vocab_size, self.topk,
                                                        dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.empty(c.n_routed_experts), requires_grad=False)

    def check_loaded(self, name: str, t: torch.Tensor) -> str | None:
        """Why a checkpoint's integer tensor `name` of this gate cannot be used (None when
        it can): tid2eid must hold expert ids in [0, n_routed_experts). Checked at load, so
        a bad table fails there and not as an index error in the first forward."""
        if name != "tid2eid":
            return f"the gate has no integer tensor {name!r}"
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            return f"tid2eid must hold integer expert ids, got dtype {t.dtype}"
        if t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= self.n_experts:
                bad = ((t < 0) | (t >= self.n_experts)).nonzero()[0].tolist()
                return (f"tid2eid names expert {int(t[tuple(bad)])} (token {bad[0]}, slot "
                        f"{bad[1]}); the layer has experts 0..{self.n_experts - 1} "
                        f"(ids range over [{lo}, {hi}])")
        return None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router scores [T, E] from the gate's logits, in the logits' dtype."""
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits)
        if self.score_func == "softmax":
            return torch.softmax(logits, dim=-1)
        return torch.sqrt(F.softplus(logits))

    def route_weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights [T, k]: their scores, normalized over the k (softmax
        scores are not: DeepSeek's reference), times routed_scaling_factor."""
        weights = scores.gather(1, ids)
        if self.score_func != "softmax":
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] f32 (tokens [T]: the ids, for hash layers) -> expert ids [T, k]
        int64 (best first; table order for hash layers), weights [T, k] f64."""
        logits = torch.matmul(x.double(), as_f64(self.weight).T).float().double()
        scores = self.scores(logits)
        if hasattr(self, "tid2eid"):
            if tokens is None:
                raise ValueError("a hash-routed MoE layer needs the token ids")
            ids = self.tid2eid.index_select(0, tokens.to(self.tid2eid.device))
        else:
            order = torch.sort(scores + as_f64(self.bias), dim=-1, descending=True,
                               stable=True)
            ids = order.indices[:, :self.topk]
        return ids, self.route_weights(scores, ids)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter)
        self.w2 = Linear(inter, dim)
        self.w3 = Linear(dim, inter)
        self.limit = swiglu_limit

    def forward_f64(self, x64: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1.forward_f64(x64), self.w3.forward_f64(x64)
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return self.w2.forward_f64(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_f64(x.double()).float()


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        c = config
        self.gate = Gate(c, hashed=c.hash_layer(layer))
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit)
            for _ in range(c.n_routed_experts))
        if c.n_shared_experts:
            self.shared_experts = Expert(c.hidden_size,
                                         c.n_shared_experts * c.moe_intermediate_size,
                                         c.swiglu_limit)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if gemm.is_production(self):
            return production.moe_forward(self, x, tokens)
        ids, weights = self.gate(x, tokens)
        x64 = x.double()
        T, k = ids.shape
        routed = torch.zeros(T, k, x.shape[1], dtype=torch.float64, device=x.device)
        for e in torch.unique(ids).tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            out = self.experts[e].forward_f64(x64.index_select(0, rows))
            routed[rows, slots] = out * weights[rows, slots, None]
        y = routed[:, 0]
        for s in range(1, k):  # fixed summation order: best expert first
            y = y + routed[:, s]
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts.forward_f64(x64)
        return y.float()
