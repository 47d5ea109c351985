"""The production precision: weights in their shipped precision, bf16 GEMMs, grouped MoE.

`Model(..., precision="bf16")`, `Model.synthetic(..., precision="bf16")`,
`Model.from_pretrained(..., precision="bf16")` or `model.to_production()` switch a model
from the float64 reference (layers.py) to this path:
  - weights at rest as the checkpoint ships them: a Linear's `weight` is bf16, or FP8 E4M3
    with `weight_scale` (one scale per weight_block, 128x128 in DeepSeek's release), or
    packed FP4 (int8, two E2M1 codes a byte) with UE8M0 `weight_scale` per 32 inputs. A
    float32 (synthetic or dequantized) weight is cast to bf16. No float32/float64 copy of
    a quantized weight is kept: `linear` dequantizes it tile by tile (`TILE_BYTES` of
    bf16 at a time) inside the matmul (gemm.py: the per-row GEMM and norm every layer calls).
  - GEMM inputs and outputs in bf16; RMSNorm, mHC, the router and the SwiGLU gate in
    float32; the residual stream stays float32 (it is what the next norm reads).
  - MoE: the (token, slot) pairs sorted by expert and run as grouped GEMMs
    (torch._grouped_mm on CUDA sm_90+), one padded bmm (CPU), or one GEMM per expert
    (quantized experts), the weighted outputs summed back with index_add (`moe_forward`,
    moe_grouped.py says which and why).
  - FP8 weights: torch's block-scaled FP8 GEMM on CUDA sm_90 (activations quantized per
    1x128 block on the fly), tile-by-tile dequantization elsewhere (fp8_gemm.py).
  - CPU GEMMs of at most SMALL_ROWS rows (a decode step) with bf16 weights run in float32
    on a float32 copy of the weight (`gemm.cpu_f32`, up to CPU_F32_BYTES per process): a
    one-row bf16 GEMM on the CPU pays a setup that float32's GEMV does not
    (docs/performance.md#model). Inputs are the same bf16 values (exact in float32) and
    both accumulate in float32, so only the summation order differs; the output is rounded
    to bf16 as before. dsv41.cpu_shortcuts.off() turns this and the other CPU-only paths off.
  - attention, compression, the indexer, top-k and cache writes are the reference path's
    own ops on the same stored formats, so a state written by one precision is read by
    the other (tests/model/test_production.py).
Which module runs which path: a Linear follows its weight's dtype (float32: reference);
the others follow the `_dsv41_production` flag `to_production` sets on every module.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from . import moe_grouped
from .gemm import FP4_BLOCK, PRODUCTION_FLAG, linear, transposed

__all__ = ["PRECISIONS", "default_precision", "moe_forward", "moe_path", "quantize_fp8", "to_production",
           "weight_bytes"]

PRECISIONS = ("reference", "bf16")


def default_precision(device: str | torch.device) -> str:
    """What the engine and demo run: the production path on CUDA; the float64 reference on
    the CPU, where the engine's exact replay relies on its batch invariance (bf16 GEMMs are
    not batch invariant) - see docs/model.md, "Precision"."""
    return "bf16" if torch.device(device).type == "cuda" else "reference"


# ---- attention ---------------------------------------------------------------------------

ATTEND_CHUNK = 128   # queries per step: bounds the score and probability tiles


def attend(q: torch.Tensor, swa: torch.Tensor, swa_idx: torch.Tensor, kv: torch.Tensor,
           kv_idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """attention.attend (same arguments, same softmax with sink) chunked over queries, as
    dense products over candidate rows instead of per-query gathers: scores and softmax in
    float32, the probabilities-times-values product from bf16 inputs.

    The SWA rows a chunk reaches lie in a short range of `swa` (the ring plus the chunk and
    its window); when the global entries are few (at most twice the top-k width, as in
    short prompts), all of them join that range. A count matrix [chunk, rows] says how
    often each query selected each row (0: not at all; duplicates count twice, as in the
    gathered softmax), so scores are one product with the rows, masked where the count is
    0, and the probabilities times the counts are one product with the values. Only with
    many global entries are the selected ones gathered per query."""
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    swa, kv, sink = swa.float(), kv.float(), sink.float()
    if kv.shape[0] == 0:
        kv_idx = kv_idx[:, :0]
    K = kv_idx.shape[1]
    dense_kv = 0 < K and kv.shape[0] <= 2 * K
    for t0 in range(0, T, ATTEND_CHUNK):
        t1 = min(T, t0 + ATTEND_CHUNK)
        qc, si, ki = q[t0:t1].float(), swa_idx[t0:t1].long(), kv_idx[t0:t1].long()
        valid_s, valid_k = si >= 0, ki >= 0
        hi = max(int(si.max()) + 1, 1) if si.numel() else 1
        lo = min(int(si.masked_fill(~valid_s, hi - 1).min()), hi - 1) if si.numel() else 0
        rows, idx, hit = swa[lo:hi], [(si - lo).clamp(min=0)], [valid_s]
        if dense_kv:
            rows = torch.cat((rows, kv))
            idx.append(ki.clamp(min=0) + (hi - lo))
            hit.append(valid_k)
        count = torch.zeros(t1 - t0, rows.shape[0], dtype=torch.float32, device=q.device)
        count.scatter_add_(1, torch.cat(idx, 1), torch.cat(hit, 1).float())
        scores = torch.matmul(qc, rows.T).mul_(scale)                   # [c, H, R]
        scores.masked_fill_((count == 0)[:, None, :], -math.inf)
        m = torch.maximum(scores.amax(-1), sink[None, :])
        keys = None
        if K and not dense_kv:
            keys = kv[ki.clamp(min=0)]                                   # [c, K, D]
            s_kv = torch.einsum("thd,tkd->thk", qc, keys).mul_(scale)
            s_kv.masked_fill_(~valid_k[:, None, :], -math.inf)
            m = torch.maximum(m, s_kv.amax(-1))
        p = torch.exp_(scores.sub_(m[..., None])).mul_(count[:, None, :])
        denom = p.sum(-1) + torch.exp(sink[None, :] - m)
        # P.V with bf16 inputs (float32 accumulation, as FlashAttention does on a GPU): the
        # output is rounded to bf16 for wo_a anyway, and oneDNN's bf16 GEMM is faster than
        # float32 here (docs/performance.md#model); Q.K stays float32 (scores feed the exp).
        o = torch.matmul(p.to(torch.bfloat16), rows.to(torch.bfloat16)).float()
        if keys is not None:
            pk = torch.exp_(s_kv.sub_(m[..., None]))
            denom += pk.sum(-1)
            o += torch.einsum("thk,tkd->thd", pk, keys)
        out[t0:t1] = o / denom[..., None]
    return out


def attend_one(q: torch.Tensor, codec, swa_codes: torch.Tensor, swa_scales: torch.Tensor,
               swa_idx: torch.Tensor, kv_codes: torch.Tensor | None,
               kv_scales: torch.Tensor | None, kv_idx: torch.Tensor, sink: torch.Tensor,
               scale: float, kv_decoded: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` for one query on the CPU (a per-sequence decode step) from the stored rows:
    only the SWA rows it reads are decoded (its valid slots, found on the host: this path is
    the per-sequence one, never the paged step), the selected entries are decoded too or,
    given kv_decoded (codec.decode_main of every entry: RowStore.decoded's copy), gathered
    from it; then one float32 softmax with the sink and one product with the values. A row
    selected twice counts twice, as in the gathered softmax. q [1, H, D] -> [1, H, D]
    float32."""
    si = swa_idx[0].long()
    si = si[si >= 0]
    parts = [codec.decode_swa(swa_codes.index_select(0, si), swa_scales.index_select(0, si))]
    if kv_codes is not None and kv_idx.shape[1]:
        ki = kv_idx[0].long()
        ki = ki[ki >= 0]
        if ki.numel():
            parts.append(kv_decoded.index_select(0, ki) if kv_decoded is not None else
                         codec.decode_main(kv_codes.index_select(0, ki),
                                           kv_scales.index_select(0, ki)))
    rows = (torch.cat(parts) if len(parts) > 1 else parts[0]).float()
    sink = sink.float()
    if rows.shape[0] == 0:         # nothing visible: the sink takes all the probability
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    s = torch.mm(q[0].float(), rows.T).mul_(scale)                      # [H, R]
    m = torch.maximum(s.amax(-1), sink)
    p = torch.exp_(s.sub_(m[:, None]))
    denom = p.sum(-1).add_(torch.exp(sink - m))
    return torch.mm(p, rows).div_(denom[:, None])[None]


# ---- MoE ---------------------------------------------------------------------------------

def gate_forward(gate: nn.Module, x: torch.Tensor, tokens: torch.Tensor | None):
    """The router in float32: expert ids [T, k], weights [T, k] float32."""
    scores = gate.scores(torch.mm(x.float(), transposed(gate.weight.float())))
    if hasattr(gate, "tid2eid"):
        if tokens is None:
            raise ValueError("a hash-routed MoE layer needs the token ids")
        ids = gate.tid2eid.index_select(0, tokens.to(gate.tid2eid.device))
    else:
        ids = torch.sort(scores + gate.bias.float(), dim=-1, descending=True,
                         stable=True).indices[:, :gate.topk]
    return ids, gate.route_weights(scores, ids)


def expert_forward(expert: nn.Module, xb: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert on bf16 rows; the activation in float32, bf16 out."""
    gate, up = linear(xb, expert.w1).float(), linear(xb, expert.w3).float()
    if expert.limit > 0:
        gate = gate.clamp(max=expert.limit)
        up = up.clamp(-expert.limit, expert.limit)
    return linear((F.silu(gate) * up).to(torch.bfloat16), expert.w2)


def moe_forward(moe: nn.Module, x: torch.Tensor, tokens: torch.Tensor | None, *,
                path: str | None = None, grouped_mm=None) -> torch.Tensor:
    """Routed experts plus the shared experts; float32 [T, hidden] out. The (token, slot)
    pairs are sorted by expert and the routed experts run as moe_grouped.moe_path says
    (`path` forces one: tests): grouped GEMMs (CUDA), one padded bmm (CPU) or a per-expert
    loop (quantized experts). With bf16 experts the shared expert is one more group of the
    same GEMMs, every token routed to it with weight 1 (moe_grouped.stacked_weights). The
    grouped GEMMs, and the padded bmm of a decode-sized call, never read a device value on
    the host; the loop and the padded bmm of a large call read the expert counts."""
    ids, weights = gate_forward(moe.gate, x, tokens)
    T = ids.shape[0]
    xb = x.to(torch.bfloat16)
    path = path or moe_path(moe, x.device)
    E = len(moe.experts)
    # the stack (checked once per call: run_routed reads it too) says whether the shared
    # expert is one of its groups (moe_grouped.shared_in_stack)
    stack = moe_grouped.stacked_weights(moe) if path != "loop" else None
    fused = stack is not None and stack[0].shape[0] > E
    if fused:      # the shared expert as group E, every token's extra slot
        ids = F.pad(ids, (0, 1), value=E)
        weights = F.pad(weights, (0, 1), value=1.0)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    rows = order // k
    # each group's first row among the sorted pairs; bincount would read a max on the host
    starts = torch.searchsorted(sorted_ids, moe_grouped.group_ids(moe, E + fused, x.device))
    xs = xb.index_select(0, rows)
    routed = None
    if path != "loop":
        routed = moe_grouped.run_routed(moe, path, xs, starts, grouped_mm,
                                        groups_of_rows=sorted_ids, tokens=T, stack=stack)
    if routed is None:
        counts = torch.diff(starts, append=starts.new_tensor([T * k]))
        routed = xs.new_empty(T * k, x.shape[1])
        at = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                expert = moe.experts[e] if e < E else moe.shared_experts
                routed[at:at + n] = expert_forward(expert, xs[at:at + n])
                at += n
    # bf16 x float32 promotes to float32 in one op: routed.float() * w, exactly
    out = torch.mul(routed, weights.reshape(-1).index_select(0, order)[:, None])
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    y.index_add_(0, rows, out)
    if hasattr(moe, "shared_experts") and not fused:
        y += expert_forward(moe.shared_experts, xb).float()
    return y


def moe_path(moe: nn.Module, device: torch.device) -> str:
    """moe_grouped.moe_path_for, cached per layer (again if the device or the experts'
    storage dtype changes)."""
    key = (device, moe.experts[0].w1.weight.dtype, moe.experts[-1].w2.weight.dtype)
    cached = getattr(moe, "_dsv41_moe_path", None)
    if cached is None or cached[0] != key:
        cached = (key, moe_grouped.moe_path_for(moe, device)[0])
        object.__setattr__(moe, "_dsv41_moe_path", cached)
    return cached[1]


# ---- weights -----------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (float8_e4m3fn codes, float32 scales [ceil(out/b0),
    ceil(in/b1)]) with weight ~= codes * scale of its block (DeepSeek's layout; used to
    build FP8 test checkpoints and by `to_production(fp8=True)`)."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    po, pi = math.ceil(out_dim / b0) * b0, math.ceil(in_dim / b1) * b1
    padded = torch.zeros(po, pi, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(po // b0, b0, pi // b1, b1)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.view(po, pi)[:out_dim, :in_dim].contiguous(), scale


def set_weight(lin: nn.Module, weight: torch.Tensor, scale: torch.Tensor | None = None,
               block: tuple[int, int] | None = None) -> None:
    """Store a production weight (bf16, FP8 + block scales, or packed FP4 + scales)."""
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if scale is None:
        if "weight_scale" in lin._buffers:
            del lin._buffers["weight_scale"]
        return
    lin.register_buffer("weight_scale", scale)
    if block is not None:
        lin.weight_block = tuple(block)


def take_quantized(tensors: dict[str, torch.Tensor], quant) -> dict[str, tuple]:
    """Remove the FP8 / packed-FP4 `X.weight` (+ `X.scale` / `X.weight_scale_inv`) pairs
    from a checkpoint's tensors: {X: (weight, scale, block)} for `place_quantized`. The
    layouts and their checks are the loader's (weights.py)."""
    from .weights import DEFAULT_FP8_BLOCK, WeightError
    quant = dict(quant or {})
    block = tuple(quant.get("weight_block_size") or DEFAULT_FP8_BLOCK)
    out = {}
    for name in [n for n in tensors if n.endswith(".weight")]:
        base = name.removesuffix(".weight")
        scale_name = next((s for s in (f"{base}.scale", f"{base}.weight_scale_inv")
                           if s in tensors), None)
        t = tensors[name]
        if t.dtype == torch.float8_e4m3fn and scale_name is not None:
            b0, b1 = block
            want = (math.ceil(t.shape[0] / b0), math.ceil(t.shape[1] / b1))
            if tuple(tensors[scale_name].shape) != want:
                raise WeightError(f"tensor {name!r}: FP8 weight {tuple(t.shape)} with block "
                                  f"{block} needs scales of shape {want}, got "
                                  f"{tuple(tensors[scale_name].shape)}")
            out[base] = (t, tensors[scale_name], block)
        elif (t.dtype in (torch.int8, torch.uint8) and scale_name is not None
              and str(quant.get("expert_dtype", "")).lower() == "fp4"):
            want = (t.shape[0], 2 * t.shape[1] // FP4_BLOCK)
            if tuple(tensors[scale_name].shape) != want:
                raise WeightError(f"tensor {name!r}: FP4 weight {tuple(t.shape)} (packed) "
                                  f"needs scales of shape {want}, got "
                                  f"{tuple(tensors[scale_name].shape)}")
            out[base] = (t, tensors[scale_name], None)
        else:
            continue
        del tensors[name], tensors[scale_name]
    return out


def place_quantized(model: nn.Module, kept: dict[str, tuple], device) -> None:
    """Store `take_quantized`'s weights on their Linears (shapes checked)."""
    from .layers import Linear
    from .weights import WeightError
    for base, (w, scale, block) in kept.items():
        lin = model.get_submodule(base)
        if not isinstance(lin, Linear):
            raise WeightError(f"tensor {base}.weight: quantized, but {base} is not a Linear")
        in_dim = w.shape[1] * (2 if block is None else 1)
        if (w.shape[0], in_dim) != (lin.out_features, lin.in_features):
            raise WeightError(f"tensor {base}.weight: holds a [{w.shape[0]}, {in_dim}] "
                              f"weight, expected [{lin.out_features}, {lin.in_features}]")
        set_weight(lin, w.to(device), scale.to(device), block)


def to_production(model: nn.Module, *, fp8: bool = False,
                  block: tuple[int, int] = (128, 128)) -> nn.Module:
    """Switch `model` to the production path in place. Float32 Linear weights become bf16
    (fp8=True: FP8 E4M3 with `block` scales, as DeepSeek ships its dense weights); weights
    already stored bf16/FP8/FP4 stay as they are; the reference's float64 caches are
    dropped."""
    from .layers import Embedding, Linear
    with torch.no_grad():
        for m in model.modules():
            setattr(m, PRODUCTION_FLAG, True)
            if isinstance(m, Embedding) and m.weight.dtype == torch.float32:
                m.weight = nn.Parameter(m.weight.detach().to(torch.bfloat16),
                                        requires_grad=False)
            if isinstance(m, Linear) and m.weight.dtype == torch.float32:
                w = m.weight.detach()
                if fp8:
                    codes, scale = quantize_fp8(w, block)
                    set_weight(m, codes, scale, block)
                else:
                    set_weight(m, w.to(torch.bfloat16))
        for p in model.parameters():
            if hasattr(p, "_dsv41_f64"):
                del p._dsv41_f64
    model.precision = "bf16"
    return model


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers at rest, by dtype name."""
    out: dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
