"""A differentiable, batched forward of the V4.1 model for training.

`Model._run` is the serving forward: per-sequence states, stored KV formats, float64 math,
no autograd. Training needs the same function of the same parameters with gradients, over
a batch of equal-length sequences all starting at position 0 (a plain prefill), so this
module recomputes it from the model's own submodules' weights:

- the KV is kept unquantized (the `kv_dtype="float32"` reference mode): tests check that
  this forward's logits equal `Model(kv_dtype="float32").prefill(..., return_all_logits=True)`
  (tests/train/test_forward.py), so what is trained is exactly what the reference runs;
- attention is computed densely with masks (the SWA window, then the selected global
  entries), which is the same softmax as `attention.attend` over gathered rows;
- selection uses the reference ops (`ops.reference.topk_visible`, `candidate_blocks`) on
  float64 indexer scores, so ties break as they do at inference;
- the indexer is trained the way DeepSeek trains its lightning indexer (DeepSeek-V3.2):
  its inputs are detached from the main model, and its loss is the KL divergence from the
  main attention's distribution over the visible global entries (summed over heads and
  over every layer that uses the selection, renormalized) to the softmax of the index
  scores; `dense=True` runs the main attention over every visible entry (the warm-up
  stage), otherwise over the top-k (the sparse stage);
- MoE routing is the serving rule (sqrtsoftplus scores, top-k of score + bias); the bias
  is not trained by gradient but steered by the load (`balance_bias`, DeepSeek-V3's
  auxiliary-loss-free balancing).

Only hc_mult = 1 (the small presets' plain residual) and V4.1's non-overlapping
compressors without `ape` are supported: what the shipped trained model uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import MODE_FULL, MODE_REINDEX, ModelConfig
from ..model.indexer import hadamard
from ..model.layers import rms_normalize
from ..ops import reference as ref_ops

__all__ = ["ForwardOutput", "check_trainable", "train_forward", "balance_bias"]


@dataclass
class ForwardOutput:
    logits: torch.Tensor                                  # [B, T, vocab]
    index_kl: dict[int, torch.Tensor] = field(default_factory=dict)   # index layer -> scalar
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E] counts
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index layer -> [B,T,K] ids


def check_trainable(config: ModelConfig) -> None:
    """Raise ValueError when the config uses machinery this forward does not model."""
    problems = []
    if config.hc_mult != 1:
        problems.append(f"hc_mult={config.hc_mult} (mHC)")
    if config.compressor_ape or config.overlap_compress_ratios or config.indexer_compressor:
        problems.append("V4 compressors (ape / overlapping windows / indexer compressor)")
    if config.dense_compress_ratios and any(r in config.dense_compress_ratios
                                            for r in config.compress_ratios):
        problems.append("dense (HCA) layers")
    if config.num_hash_layers:
        problems.append("hash-routed MoE layers")
    if config.scoring_func != "sqrtsoftplus":
        problems.append(f"scoring_func {config.scoring_func!r} (the router is sqrtsoftplus)")
    if problems:
        raise ValueError(f"config {config.name!r} cannot be trained by dsv41.train: "
                         + "; ".join(problems))


def _w(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return p if p.dtype == dtype else p.to(dtype)


def _lin(x: torch.Tensor, mod, dtype) -> torch.Tensor:
    return torch.matmul(x, _w(mod.weight, dtype).T)


def _norm(x: torch.Tensor, mod, dtype) -> torch.Tensor:
    return rms_normalize(x, mod.eps) * _w(mod.weight, dtype)


def _rope(rope, x: torch.Tensor, pos: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """rope.rotate for x [..., T, *, D] with positions [T] on axis `1` (batch first)."""
    angles = pos.to(torch.float64)[:, None] * rope.freqs.to(x.device)[None, :]
    if inverse:
        angles = -angles
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (rope.dim // 2,)
    cos = torch.cos(angles).view(shape).to(x.dtype)
    sin = torch.sin(angles).view(shape).to(x.dtype)
    tail = x[..., -rope.dim:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    return torch.cat((x[..., :-rope.dim], rotated), -1)


def _fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x with the stored format's rounding in the forward and an identity gradient
    (straight-through): what the serving forward reads back from the cache."""
    from .. import formats
    quant, dequant = {"nvfp4": (formats.quantize_nvfp4, formats.dequantize_nvfp4),
                      "fp8_swa": (formats.quantize_fp8_swa, formats.dequantize_fp8_swa),
                      "mxfp4": (formats.quantize_mxfp4, formats.dequantize_mxfp4)}[fmt]
    flat = x.detach().float().reshape(-1, x.shape[-1]).contiguous()
    q = dequant(*quant(flat)).view(x.shape).to(x.dtype)
    return x + (q - x).detach()


def _compress(comp, x: torch.Tensor, dtype) -> torch.Tensor:
    """Normalized entries [B, n, D] of the complete blocks of x [B, T, hidden]."""
    m = comp.ratio
    kv = _lin(x, comp.wkv, dtype)
    if m == 1:
        return _norm(kv, comp.norm, dtype)
    B, T, D = kv.shape
    n = T // m
    kv = kv[:, :n * m].view(B, n, m, D)
    score = _lin(x[:, :n * m], comp.wgate, dtype).view(B, n, m, D)
    return _norm((kv * torch.softmax(score, dim=2)).sum(2), comp.norm, dtype)


def _index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """I[b,t,j] = sum_h w[b,t,h] relu(q[b,t,h] . k[b,j])."""
    return torch.einsum("bthn,bth->btn", torch.einsum("bthd,bnd->bthn", q, k).clamp(min=0), w)


def _visible_mask(T: int, n: int, ratio: int, device) -> torch.Tensor:
    vis = (torch.arange(T, device=device) + 1) // ratio
    return torch.arange(n, device=device)[None, :] < vis[:, None]        # [T, n]


def _select(p, c: ModelConfig, scores: torch.Tensor, vis_n: torch.Tensor,
            candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An index layer's top-k entry ids [B, T, K] (ascending, -1 padded; as
    Indexer.select) from its scores [B, T, n] (float32), and the candidate pool [B*T, C]
    when it is the candidate source."""
    B, T, n = scores.shape
    flat = scores.reshape(B * T, n)
    vis = vis_n[None].expand(B, T).reshape(-1)
    if p.mode == MODE_FULL:
        idx = ref_ops.topk_visible(flat, vis, c.index_topk)
        cands = None
        if p.layer == c.candidate_source_layer_id:
            cands = ref_ops.candidate_blocks(flat, vis, c.candidate_block_size,
                                             c.candidate_topk_blocks)
        return idx.long().view(B, T, -1), cands
    if p.mode != MODE_REINDEX or candidates is None:
        raise RuntimeError(f"layer {p.layer}: no candidate pool for a {p.mode} layer")
    cs = flat.gather(1, candidates.clamp(min=0).long()).masked_fill(candidates < 0, -math.inf)
    chosen = ref_ops.topk_visible(cs, (candidates >= 0).sum(1), c.index_topk)
    picked = torch.where(chosen >= 0, candidates.gather(1, chosen.clamp(min=0).long()), -1)
    return picked.long().view(B, T, -1), None


def train_forward(model, tokens: torch.Tensor, *, dense: bool = False,
                  dtype: torch.dtype = torch.float32, index_loss: bool = True,
                  kl_stride: int = 1, fake_quant: bool = False) -> ForwardOutput:
    """Logits [B, T, vocab] of tokens [B, T] (int64) as a plain prefill from position 0,
    with the indexer KL terms (index_loss) and per-layer expert loads.

    kl_stride: the indexer KL is computed at the queries t = kl_stride - 1 (mod kl_stride)
    (default: all); the attention distribution it needs is a full [queries, entries]
    softmax per layer, so training samples queries.
    fake_quant: read the KV as the stored formats round it (NVFP4 entries, FP8 SWA rows,
    Hadamard-rotated MXFP4 indexer queries and keys for the selection), with
    straight-through gradients: quantization-aware fine-tuning for the serving forward."""
    c = model.config
    check_trainable(c)
    if model.options.get("kv_dtype") != "float32":
        raise ValueError("train_forward models the unquantized KV: build the model with "
                         "kv_dtype='float32'")
    B, T = tokens.shape
    dev = tokens.device
    pos = torch.arange(T, device=dev)
    W = c.sliding_window
    out = ForwardOutput(logits=torch.empty(0))
    h = _w(model.embed.weight, dtype)[tokens]                              # [B, T, hidden]
    entries: dict[int, torch.Tensor] = {}          # kv source -> [B, n, D]
    ikeys: dict[int, torch.Tensor] = {}            # kv source -> [B, n, Di] (detached path)
    selection: dict[int, torch.Tensor] = {}        # index layer -> [B, T, K] entry ids
    candidates: torch.Tensor | None = None         # [B*T, C] positions (candidate source)
    index_logits: dict[int, tuple] = {}            # index layer -> (q, w, keys), with grad
    attn_mass: dict[int, torch.Tensor] = {}        # index layer -> [B, R, n] (detached)
    kl_rows = torch.arange(kl_stride - 1, T, kl_stride, device=dev)     # KL query positions
    # SWA: query t sees positions t-W+1 .. t, slot j holding position t-W+1+j
    swa_valid = (pos[:, None] - W + 1 + torch.arange(W, device=dev)[None, :]) >= 0   # [T, W]
    for block in model.layers:
        p, attn = block.attn.plan, block.attn
        x = _norm(h, block.attn_norm, dtype)
        qr = _norm(_lin(x, attn.wq_a, dtype), attn.q_norm, dtype)
        q = rms_normalize(_lin(qr, attn.wq_b, dtype).view(B, T, c.num_heads, c.head_dim), c.rms_norm_eps)
        q = _rope(attn.rope, q, pos)
        swa = _rope(attn.rope, _norm(_lin(x, attn.wkv, dtype), attn.kv_norm, dtype), pos)
        if fake_quant:
            swa = _fake_quant(swa, "fp8_swa")
        windows = torch.cat((swa.new_zeros(B, W - 1, c.head_dim), swa), 1).unfold(1, W, 1)
        scale = attn.softmax_scale
        logit_parts = [torch.einsum("bthd,btdw->bthw", q, windows).mul(scale)
                       .masked_fill(~swa_valid[None, :, None], -math.inf)]
        kv = kv_rows = None
        if p.compress_ratio:
            m = p.compress_ratio
            if p.owns_kv:
                latent = _compress(attn.compressor, x, dtype)
                n = latent.shape[1]
                epos = torch.arange(n, device=dev) * m
                entries[p.layer] = _rope(attn.rope, latent, epos)
                if fake_quant:
                    entries[p.layer] = _fake_quant(entries[p.layer], "nvfp4")
                if p.owns_indexer_keys:
                    ix = attn.indexer
                    k = _norm(_lin(latent.detach(), ix.wk, dtype), ix.k_norm, dtype)
                    ikeys[p.layer] = _rope(ix.rope, k, epos)
            kv = entries[p.kv_source]
            n = kv.shape[1]
            visible = _visible_mask(T, n, m, dev)
            if p.owns_index_query:
                ix = attn.indexer
                iq = _lin(qr.detach(), ix.wq_b, dtype).view(B, T, c.index_n_heads, c.index_head_dim)
                iq = _rope(ix.rope, iq, pos)
                iw = _lin(x.detach(), ix.weights_proj, dtype) * ix.weight_scale
                keys = ikeys[p.index_key_source]
                index_logits[p.layer] = (iq, iw, keys)
                with torch.no_grad():
                    if fake_quant:   # the stored selection: (rotated) MXFP4 q and k
                        rot = hadamard if model.options["indexer_rotation"] else (lambda t: t)
                        sq = _fake_quant(rot(iq.reshape(-1, iq.shape[-1])), "mxfp4").view(iq.shape)
                        sk = _fake_quant(rot(keys.reshape(-1, keys.shape[-1])), "mxfp4").view(keys.shape)
                    else:
                        sq, sk = iq, keys
                    s64 = _index_scores(sq.double(), iw.double(), sk.double()).float()
                    selection[p.layer], cands = _select(p, c, s64, visible.sum(1), candidates)
                    if cands is not None:
                        candidates = cands
            if dense or p.dense:      # every visible entry: a masked [T, n] softmax part
                logit_parts.append(torch.einsum("bthd,bnd->bthn", q, kv).mul(scale)
                                   .masked_fill(~visible[None, :, None], -math.inf))
            else:                     # the top-k: gather the selected rows [B, T, K, D]
                idx = selection[p.index_source]
                flat = (torch.arange(B, device=dev)[:, None, None] * n + idx.clamp(min=0))
                kv_rows = kv.reshape(B * n, -1).index_select(0, flat.reshape(-1)).view(
                    B, T, -1, c.head_dim)
                logit_parts.append(torch.einsum("bthd,btkd->bthk", q, kv_rows).mul(scale)
                                   .masked_fill((idx < 0)[:, :, None], -math.inf))
            if index_loss and not p.dense and p.index_source in index_logits:
                with torch.no_grad():   # what this layer would pay each entry, at kl rows
                    full = torch.cat((logit_parts[0][:, kl_rows],
                                      torch.einsum("bthd,bnd->bthn", q[:, kl_rows], kv).mul(scale)
                                      .masked_fill(~visible[kl_rows][None, :, None], -math.inf)),
                                     -1)
                    probs = torch.softmax(full, -1)[..., W:].sum(2)            # [B, R, n]
                    prev = attn_mass.get(p.index_source)
                    attn_mass[p.index_source] = probs if prev is None else prev + probs
        sink = _w(attn.attn_sink, dtype)[None, None, :, None].expand(B, T, -1, 1)
        probs = torch.softmax(torch.cat([*logit_parts, sink], -1), -1)
        o = torch.einsum("bthw,btdw->bthd", probs[..., :W], windows)
        if kv is not None:
            pg = probs[..., W:-1]
            o = o + (torch.einsum("bthn,bnd->bthd", pg, kv) if kv_rows is None
                     else torch.einsum("bthk,btkd->bthd", pg, kv_rows))
        o = _rope(attn.rope, o, pos, inverse=True)
        G, R = c.o_groups, c.o_lora_rank
        wa = _w(attn.wo_a.weight, dtype).view(G, R, -1)
        mid = torch.einsum("btgk,grk->btgr", o.reshape(B, T, G, -1), wa).reshape(B, T, G * R)
        h = h + _lin(mid, attn.wo_b, dtype)
        y, load = _moe(block.ffn, _norm(h, block.ffn_norm, dtype), c, dtype)
        out.expert_load[p.layer] = load
        h = h + y
    out.logits = _lin(_norm(h, model.norm, dtype), model.head, dtype)
    out.topk = selection
    if index_loss:
        for layer, (iq, iw, keys) in index_logits.items():
            mass = attn_mass.get(layer)
            if mass is None:
                continue
            n = keys.shape[1]
            visible = _visible_mask(T, n, c.compress_ratios[layer], dev)[kl_rows][None]  # [1,R,n]
            scores = torch.einsum("brh,brhn->brn", iw[:, kl_rows], torch.einsum(
                "brhd,bnd->brhn", iq[:, kl_rows], keys).clamp(min=0))
            target = mass.masked_fill(~visible, 0)
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
            logq = torch.log_softmax(scores.float().masked_fill(~visible, -math.inf), -1)
            kl = (target * (torch.log(target.clamp(min=1e-30)) - logq)).masked_fill(~visible, 0)
            rows = visible.expand_as(kl).any(-1)
            out.index_kl[layer] = kl.sum(-1)[rows].mean()
    return out


def _expert(e, x: torch.Tensor, dtype) -> torch.Tensor:
    gate, up = _lin(x, e.w1, dtype), _lin(x, e.w3, dtype)
    if e.limit > 0:
        gate = gate.clamp(max=e.limit)
        up = up.clamp(-e.limit, e.limit)
    return _lin(F.silu(gate) * up, e.w2, dtype)


def _moe(moe, x: torch.Tensor, c: ModelConfig, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE output and the number of tokens routed to each expert [E]."""
    gate = moe.gate
    scores = torch.sqrt(F.softplus(_lin(x, gate, dtype)))                     # [B, T, E]
    with torch.no_grad():
        biased = (scores + _w(gate.bias, dtype)).double()
        order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
        ids = order[..., :gate.topk]                                          # [B, T, k]
    weights = scores.gather(-1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * gate.route_scale
    E = c.n_routed_experts
    dense_w = torch.zeros(*scores.shape, dtype=weights.dtype, device=x.device)
    dense_w = dense_w.scatter(-1, ids, weights)                               # [B, T, E]
    y = sum(_expert(moe.experts[e], x, dtype) * dense_w[..., e:e + 1] for e in range(E))
    if hasattr(moe, "shared_experts"):
        y = y + _expert(moe.shared_experts, x, dtype)
    load = torch.bincount(ids.reshape(-1), minlength=E).to(torch.float32)
    return y, load


@torch.no_grad()
def balance_bias(model, loads: dict[int, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the routing bias of experts that
    got fewer tokens than the mean, lower it for those that got more."""
    for layer, load in loads.items():
        bias = model.layers[layer].ffn.gate.bias
        bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
