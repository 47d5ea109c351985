"""The CSA2 compressor of a Full (KV-source) layer: its global main-KV entries.

For ratio m, each block of m consecutive tokens [b*m, b*m + m) becomes one entry:
kv = W_kv x and score = W_gate x per token, a softmax of the scores over the m tokens per
channel, the weighted sum of kv, RMSNorm (`norm`), then RoPE at the block's first position
b*m; the entry is stored in NVFP4. No overlapping windows, no absolute position bias (both
were in V4's CSA). Ratio 1 is uncompressed: entry = RoPE(norm(W_kv x)), no gate.

An entry exists once its block is complete; the tokens of the unfinished block are kept as
their kv and score projections (float32) in the state (`SequenceState.pending`), so a block
split across calls pools exactly the values a single call pools.

The un-RoPE'd normalized entry (the "latent") also feeds the indexer keys.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .context import ForwardContext
from .layers import Linear, RMSNorm
from .rope import Rope

__all__ = ["Compressor"]


class Compressor(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.ratio = config.compress_ratios[layer]
        self.wkv = Linear(config.hidden_size, config.head_dim)
        if self.ratio > 1:
            self.wgate = Linear(config.hidden_size, config.head_dim)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def pool(self, kv: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        """Normalized entries (float32 [n, D]) of n complete blocks: kv, score [n*m, D]."""
        m = self.ratio
        if m == 1:
            return self.norm(kv)
        n, D = kv.shape[0] // m, kv.shape[1]
        w = torch.softmax(score.double().view(n, m, D), dim=1)
        blocks = kv.double().view(n, m, D) * w
        pooled = blocks[:, 0]
        for j in range(1, m):  # fixed summation order
            pooled = pooled + blocks[:, j]
        return self.norm(pooled.float())

    def append(self, kv_input: torch.Tensor, ctx: ForwardContext, rope: Rope,
               indexer: nn.Module | None) -> None:
        """Stage the entries (and indexer keys) that the segments' new tokens complete.

        kv_input [total tokens, hidden]: the layer's normalized input (for the decoder's
        Full layer: attn_norm of the encoder's final hidden state)."""
        m = self.ratio
        kv_all = self.wkv(kv_input)
        score_all = self.wgate(kv_input) if m > 1 else None
        for seg in ctx.segments:
            kv, score = kv_all[seg.rows], None if score_all is None else score_all[seg.rows]
            # Replay: tokens whose global KV is cached are skipped (read, never recomputed);
            # cached_until is aligned to every ratio, so no partial block precedes it.
            skip = 0 if seg.cached_until is None else min(seg.length,
                                                          max(0, seg.cached_until - seg.start))
            start = seg.start + skip
            if skip:
                kv = kv[skip:]
                score = None if score is None else score[skip:]
            if m > 1:
                old_kv, old_score = seg.state.pending[self.layer]
                if skip:
                    old_kv, old_score = old_kv[:0], old_score[:0]
                kv, score = torch.cat((old_kv, kv)), torch.cat((old_score, score))
            n = kv.shape[0] // m
            first = start // m  # entries before this call
            if seg.state.main_kv[self.layer].n != first:
                raise RuntimeError(f"layer {self.layer}: state holds "
                                   f"{seg.state.main_kv[self.layer].n} entries at position "
                                   f"{start}, expected {first}")
            if m > 1:
                seg.pending_new[self.layer] = (kv[n * m:].clone(), score[n * m:].clone())
            if n == 0:
                continue
            latent = self.pool(kv[:n * m], None if score is None else score[:n * m])
            pos = (first + torch.arange(n, device=latent.device)) * m
            entry = rope.rotate(latent, pos)
            seg.state.main_kv[self.layer].stage_quantized("nvfp4", entry)
            if indexer is not None:
                seg.state.index_keys[self.layer].stage_quantized("mxfp4", indexer.key_values(latent, pos))
            ctx.record(self.layer, entry_positions=pos, latent=latent, entry=entry)
