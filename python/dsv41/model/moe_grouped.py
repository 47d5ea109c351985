"""Routed experts as grouped GEMMs on the production path (production.moe_forward).

The (token, slot) pairs are sorted by expert; expert e owns rows offs[e-1]:offs[e] of the
sorted activations. Three ways to run the experts over them, chosen by `moe_path`:
  - "grouped_mm" (CUDA, sm_90+, bf16 experts): torch._grouped_mm over the stacked expert
    weights, one call for w1|w3 and one for w2 (offs: int32 end offsets per expert);
  - "padded_bmm" (CPU, bf16 experts): each group padded to the largest (rounded up to a few
    sizes) and run as one torch.bmm per projection - on the CPU one batched call beats a GEMM
    per expert at these sizes (docs/performance.md#model), and torch._grouped_mm's CPU fallback
    is itself a loop. A call whose padding would more than double the rows (few tokens over
    many experts: decode) takes the loop instead;
  - "loop" (quantized experts - FP8/FP4 - anywhere, or a GPU/torch without grouped GEMMs):
    one GEMM per expert over its rows, each weight dequantized tile by tile.
The bf16 experts are stacked once (w13 [E, 2I, H]: w1 over w3; w2 [E, H, I]) and each
expert's Linear weights become views into the stack, so no weight is held twice; the stack
is rebuilt only if the experts' weights move or change (model.to(device)).

The "grouped_mm" path has never run on a GPU here (none was lent): the CPU tests run the
same call through torch._grouped_mm's CPU fallback and an explicit loop emulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MOE_PATHS", "grouped_mm_emulated", "moe_path", "moe_path_for", "offsets",
           "run_routed", "stacked_weights"]

MOE_PATHS = ("grouped_mm", "padded_bmm", "loop")
_STACK = "_dsv41_expert_stack"


def moe_path(*, device_type: str, capability: tuple[int, int] | None, has_grouped_mm: bool,
             expert_dtypes: set, hidden: int, inter: int) -> tuple[str, str]:
    """(path, reason) for a layer's routed experts, from explicit facts (pure: the CPU tests
    drive every branch)."""
    if expert_dtypes != {torch.bfloat16}:
        names = sorted(str(d).removeprefix("torch.") for d in expert_dtypes)
        return "loop", (f"experts stored as {names}: dequantized tile by tile, one GEMM per "
                        f"expert")
    if device_type == "cpu":
        return "padded_bmm", "CPU: groups padded to the largest and run as one bmm"
    if device_type != "cuda":
        return "loop", f"device {device_type}: no grouped GEMM used there"
    if not has_grouped_mm:
        return "loop", "this torch has no torch._grouped_mm"
    if capability is None or capability < (9, 0):
        cap = "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return "loop", f"GPU {cap}: torch._grouped_mm's CUTLASS kernel needs sm_90+"
    if hidden % 8 or inter % 8:
        return "loop", (f"hidden {hidden} / intermediate {inter} not multiples of 8 (16-byte "
                        f"aligned bf16 rows, which torch._grouped_mm needs)")
    return "grouped_mm", "CUDA sm_90+, bf16 experts: torch._grouped_mm"


def moe_path_for(moe: nn.Module, device: torch.device) -> tuple[str, str]:
    """moe_path with the facts of this torch, device and layer."""
    e0 = moe.experts[0]
    cap = None
    if device.type == "cuda" and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability(device))
    dtypes = {lin.weight.dtype for e in moe.experts for lin in (e.w1, e.w2, e.w3)}
    return moe_path(device_type=device.type, capability=cap,
                    has_grouped_mm=hasattr(torch, "_grouped_mm"), expert_dtypes=dtypes,
                    hidden=e0.w1.in_features, inter=e0.w1.out_features)


def stacked_weights(moe: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) bf16 of the routed experts, the experts' own weights
    being views into them (stacked once; again only if an expert's weight moved or
    changed)."""
    experts = moe.experts
    key = tuple((lin.weight.data_ptr(), lin.weight._version)
                for e in experts for lin in (e.w1, e.w3, e.w2))
    cached = getattr(moe, _STACK, None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    inter = experts[0].w1.out_features
    w13 = torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in experts])
    w2 = torch.stack([e.w2.weight for e in experts])
    for i, e in enumerate(experts):   # point the experts at the stack: one copy at rest
        e.w1.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
        e.w3.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
        e.w2.weight = nn.Parameter(w2[i], requires_grad=False)
    key = tuple((lin.weight.data_ptr(), lin.weight._version)
                for e in experts for lin in (e.w1, e.w3, e.w2))
    object.__setattr__(moe, _STACK, (key, w13, w2))
    return w13, w2


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Rows per expert [E] -> torch._grouped_mm's offs: int32 end offsets [E]."""
    return torch.cumsum(counts, 0).to(torch.int32)


def grouped_mm_emulated(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(x [N, K], w [E, K, M], offs) as an explicit loop: rows
    offs[e-1]:offs[e] of x times w[e] (float32 accumulation, x's dtype out)."""
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = (x[start:end].float() @ w[e].float()).to(x.dtype)
        start = end
    return out


def _swiglu(h: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
    """[.., 2I] bf16 (w1 | w3 outputs) -> silu(min(g, L)) * clamp(u, -L, L) in float32, bf16."""
    gate, up = h[..., :inter].float(), h[..., inter:].float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (F.silu(gate) * up).to(torch.bfloat16)


def run_routed(moe: nn.Module, path: str, xs: torch.Tensor, counts: torch.Tensor,
               grouped_mm=None) -> torch.Tensor | None:
    """Routed experts over the expert-sorted bf16 rows xs [N, H] (counts [E]: rows per
    expert) -> bf16 [N, H]; None when this call should take the loop (padded_bmm with too
    much padding). grouped_mm: the grouped GEMM to call (default torch._grouped_mm; the
    tests pass the emulation)."""
    w13, w2 = stacked_weights(moe)
    E, inter = w13.shape[0], w2.shape[2]
    limit = moe.experts[0].limit
    if path == "grouped_mm":
        gmm = grouped_mm or torch._grouped_mm
        offs = offsets(counts)
        h = gmm(xs, w13.transpose(1, 2), offs=offs)                 # [N, 2I]
        return gmm(_swiglu(h, inter, limit), w2.transpose(1, 2), offs=offs)
    if path != "padded_bmm":
        raise ValueError(f"unknown MoE path {path!r} (one of {MOE_PATHS})")
    from .production import _bucket   # the GEMM row sizes the CPU path already uses
    N = xs.shape[0]
    cap = _bucket(int(counts.max())) if N else 1
    if E * cap > 2 * max(N, 1) + 16:
        return None
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(E, device=xs.device), counts)
    slot = torch.arange(N, device=xs.device) - starts[expert_of] + expert_of * cap
    buf = xs.new_zeros(E * cap, xs.shape[1])
    buf[slot] = xs
    h = torch.bmm(buf.view(E, cap, -1), w13.transpose(1, 2))          # [E, cap, 2I]
    y = torch.bmm(_swiglu(h, inter, limit), w2.transpose(1, 2))      # [E, cap, H]
    return y.view(E * cap, -1)[slot]
