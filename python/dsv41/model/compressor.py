"""The compressor of a KV-source layer: its global entries (main KV, or V4's indexer keys).

For ratio m, each block of m consecutive tokens [b*m, b*m + m) becomes one entry:
kv = W_kv x and score = W_gate x per token (+ `ape[j]` for the block's j-th token when the
config has V4's learned position bias), a softmax of the scores over the pooled tokens per
channel, the weighted sum of kv, RMSNorm (`norm`); the caller applies RoPE at the block's
first position b*m and stores it. Ratio 1 is uncompressed: entry = norm(W_kv x), no gate.

Overlapping windows (V4's CSA, `plan.overlap`): `wkv`/`wgate` (and `ape`) have 2D columns;
entry b pools 2m slots per channel: the first D columns of block b-1's tokens and the last
D columns of block b's (block 0 has no predecessor: those slots get weight 0). The first D
columns (kv and score) of the last complete block are carried in the state
(`overlap`) for the next call, as transformers' DeepseekV4CSACache does (scores kept
without `ape`, which is added at pooling).

An entry exists once its block is complete; the tokens of the unfinished block are kept as
their kv and score projections (float32) in the state (`pending`), so a block split across
calls pools exactly the values a single call pools.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .context import ForwardContext, Segment
from .layers import Linear, RMSNorm
from .gemm import is_production

__all__ = ["Compressor"]


class Compressor(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dim: int | None = None,
                 state_key: int | str | None = None):
        """dim: the entry width (head_dim for main KV, index_head_dim for V4's indexer).
        state_key: where its partial-block state lives (`SequenceState.comp_state`)."""
        super().__init__()
        plan = config.layer_plan()[layer]
        self.layer, self.ratio, self.overlap = layer, plan.compress_ratio, plan.overlap
        self.dim = config.head_dim if dim is None else dim
        self.state_key = layer if state_key is None else state_key
        width = 2 * self.dim if self.overlap else self.dim
        self.wkv = Linear(config.hidden_size, width)
        if self.ratio > 1:
            self.wgate = Linear(config.hidden_size, width)
            if config.compressor_ape:
                self.ape = nn.Parameter(torch.empty(self.ratio, width), requires_grad=False)
        self.norm = RMSNorm(self.dim, config.rms_norm_eps)

    @property
    def overlap_key(self) -> str:
        return f"overlap.{self.state_key}"

    def pool(self, kv: torch.Tensor, score: torch.Tensor | None,
             carry: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Normalized entries (float32 [n, dim]) of n complete blocks: kv, score
        [n*m, width] (scores without ape); carry: the previous block's first-half (kv,
        score) [m, dim] for overlapping windows (None: no predecessor)."""
        m, D = self.ratio, self.dim
        if m == 1:
            return self.norm(kv)
        n = kv.shape[0] // m
        fast = is_production(self)   # float32, one sum; the reference: float64, fixed order
        dt = torch.float32 if fast else torch.float64
        kv = kv.to(dt).view(n, m, -1)
        score = score.to(dt).view(n, m, -1)
        if hasattr(self, "ape"):
            score = score + self.ape.to(dt)
        if self.overlap:
            prev_kv = torch.zeros(n, m, D, dtype=dt, device=kv.device)
            prev_score = torch.full((n, m, D), float("-inf"), dtype=dt,
                                    device=kv.device)
            if carry is not None:
                ape = self.ape[:, :D].to(dt) if hasattr(self, "ape") else 0.0
                prev_kv[0], prev_score[0] = carry[0].to(dt), carry[1].to(dt) + ape
            prev_kv[1:], prev_score[1:] = kv[:-1, :, :D], score[:-1, :, :D]
            kv = torch.cat((prev_kv, kv[:, :, D:]), 1)
            score = torch.cat((prev_score, score[:, :, D:]), 1)
        w = torch.softmax(score, dim=1)
        blocks = kv * w
        if fast:
            return self.norm(blocks.sum(1))
        pooled = blocks[:, 0]
        for j in range(1, blocks.shape[1]):  # fixed summation order
            pooled = pooled + blocks[:, j]
        return self.norm(pooled.float())

    def compress(self, kv_input: torch.Tensor, ctx: ForwardContext, entries_of
                 ) -> list[tuple[Segment, torch.Tensor, torch.Tensor]]:
        """Pool the blocks the segments' new tokens complete; stage the new partial-block
        (and overlap) state. kv_input [total tokens, hidden]: the layer's normalized input
        (for the decoder's Full layer: attn_norm of the encoder's final hidden state).
        entries_of(seg) -> entries the state holds before this call (a consistency check).
        Returns (segment, latent [n, dim], first positions [n]) for segments with n > 0."""
        m = self.ratio
        kv_all = self.wkv(kv_input)
        score_all = self.wgate(kv_input) if m > 1 else None
        out = []
        for seg in ctx.segments:
            kv, score = kv_all[seg.rows], None if score_all is None else score_all[seg.rows]
            # Replay: tokens whose global KV is cached are skipped (read, never recomputed);
            # cached_until is aligned to every ratio, so no partial block precedes it.
            skip = 0 if seg.cached_until is None else min(seg.length,
                                                          max(0, seg.cached_until - seg.start))
            if skip and self.overlap:
                raise NotImplementedError(f"layer {self.layer}: replay over cached global KV "
                                          f"is not supported with overlapping windows (V4)")
            start = seg.start + skip
            if skip:
                kv = kv[skip:]
                score = None if score is None else score[skip:]
            st = seg.state
            if m > 1:
                old_kv, old_score = st.comp_state(self.state_key)
                if skip:
                    old_kv, old_score = old_kv[:0], old_score[:0]
                kv, score = torch.cat((old_kv, kv)), torch.cat((old_score, score))
            n = kv.shape[0] // m
            first = start // m  # entries before this call
            if entries_of(seg) != first:
                raise RuntimeError(f"layer {self.layer}: state holds {entries_of(seg)} "
                                   f"entries at position {start}, expected {first}")
            if m > 1:
                seg.pending_new[self.state_key] = (kv[n * m:].clone(), score[n * m:].clone())
            if n == 0:
                continue
            carry = None
            if self.overlap:
                carry = st.comp_state(self.overlap_key) if first else None
                last = slice((n - 1) * m, n * m)
                seg.pending_new[self.overlap_key] = (kv[last, :self.dim].clone(),
                                                     score[last, :self.dim].clone())
            latent = self.pool(kv[:n * m], None if score is None else score[:n * m], carry)
            pos = (first + torch.arange(n, device=latent.device)) * m
            out.append((seg, latent, pos))
        return out
