"""Routed experts as grouped GEMMs on the production path (production.moe_forward).

The (token, slot) pairs are sorted by expert; expert e owns rows offs[e-1]:offs[e] of the
sorted activations. Three ways to run the experts over them, chosen by `moe_path`:
  - "grouped_mm" (CUDA, sm_90+, bf16 experts): torch._grouped_mm over the stacked expert
    weights, one call for w1|w3 and one for w2 (offs: int32 end offsets per expert);
  - "padded_bmm" (CPU, bf16 experts): each group padded to a capacity and run as one
    torch.bmm per projection - on the CPU one batched call beats a GEMM per expert at
    these sizes (docs/performance.md#model), and torch._grouped_mm's CPU fallback is itself a loop.
    For a call of at most STATIC_CAP_TOKENS tokens (a decode step) the capacity is the
    token count itself, so nothing is read on the host and every shape is static (what a
    captured or compiled step needs); for larger calls it is the largest group rounded up
    to a few sizes (read on the host, free on a CPU), and a call whose padding would more
    than double the rows takes the loop instead;
  - "loop" (quantized experts - FP8/FP4 - anywhere, or a GPU/torch without grouped GEMMs):
    one GEMM per expert over its rows, each weight dequantized tile by tile.
The bf16 experts are stacked once (w13 [E, 2I, H]: w1 over w3; w2 [E, H, I]) and each
expert's Linear weights become views into the stack, so no weight is held twice; the stack
is rebuilt only if the experts' weights move or change (model.to(device)). A shared expert
of the routed experts' shape is stacked after them (group E): moe_forward routes every
token to it with weight 1, so the shared expert costs no GEMMs of its own.

The "grouped_mm" path has never run on a GPU here (none was lent): the CPU tests run the
same call through torch._grouped_mm's CPU fallback and an explicit loop emulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gemm import bucket, cpu_f32, transposed

__all__ = ["MOE_PATHS", "STATIC_CAP_TOKENS", "grouped_mm_emulated", "moe_path",
           "moe_path_for", "offsets", "run_routed", "shared_in_stack", "stacked_weights"]

MOE_PATHS = ("grouped_mm", "padded_bmm", "loop")
# padded_bmm calls of at most this many tokens pad every group to the token count.
STATIC_CAP_TOKENS = 64
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


def _stackable_shared(moe: nn.Module) -> nn.Module | None:
    sh = getattr(moe, "shared_experts", None)
    e0 = moe.experts[0]
    if sh is None or any(getattr(sh, n).weight.shape != getattr(e0, n).weight.shape
                         or getattr(sh, n).weight.dtype != torch.bfloat16 for n in ("w1", "w2", "w3")):
        return None
    return sh


def shared_in_stack(moe: nn.Module) -> bool:
    """The shared expert is group E of stacked_weights (same shape as a routed expert)."""
    cached = None if torch.compiler.is_compiling() else _valid_stack(moe)
    if cached is not None:
        return cached[1].shape[0] > len(moe.experts)
    return _stackable_shared(moe) is not None


def _valid_stack(moe: nn.Module):
    """The cached stack while every stacked Linear still holds the weight it was given (the
    same Parameter, at the same address: model.to() or a replaced weight rebuild it; a
    change in place is a change of the stack itself, whose views the weights are)."""
    cached = moe.__dict__.get(_STACK)
    if cached is None:
        return None
    if all(params.get("weight") is p and p.data_ptr() == ptr for params, p, ptr in cached[3]):
        return cached
    return None


def stacked_weights(moe: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E', 2I, H], w2 [E', H, I]) bf16 of the routed experts (and, as group E, the
    shared expert when it has their shape: E' = E + 1), the experts' own weights being
    views into them (stacked once; again only if an expert's weight moved or was replaced:
    `_valid_stack`)."""
    cached = getattr(moe, _STACK, None)
    if torch.compiler.is_compiling():
        # a compiled step reads the stack an eager call made (its key holds data pointers,
        # which a traced graph cannot compare); compile after one eager step
        if cached is None:
            raise RuntimeError("stacked_weights: run one eager step before compiling")
        return cached[1], cached[2]
    if _valid_stack(moe) is not None:
        return cached[1], cached[2]
    experts = list(moe.experts)
    shared = _stackable_shared(moe)
    if shared is not None:
        experts.append(shared)
    inter = experts[0].w1.out_features
    w13 = torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in experts])
    w2 = torch.stack([e.w2.weight for e in experts])
    for i, e in enumerate(experts):   # point the experts at the stack: one copy at rest
        e.w1.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
        e.w3.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
        e.w2.weight = nn.Parameter(w2[i], requires_grad=False)
    lins = [(lin._parameters, lin.weight, lin.weight.data_ptr())
            for e in experts for lin in (e.w1, e.w3, e.w2)]
    object.__setattr__(moe, _STACK, (None, w13, w2, lins))
    return w13, w2


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Rows per expert [E] -> torch._grouped_mm's offs: int32 end offsets [E]."""
    return torch.cumsum(counts, 0).to(torch.int32)


def group_ids(moe: nn.Module, n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, made once per layer (searchsorted's needles)."""
    cached = getattr(moe, "_dsv41_group_ids", None)
    if cached is None or cached.shape[0] != n or cached.device != device:
        cached = torch.arange(n, device=device)
        object.__setattr__(moe, "_dsv41_group_ids", cached)
    return cached


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
    hf = h.float()
    gate, up = hf[..., :inter], hf[..., inter:]
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return (F.silu(gate) * up).to(torch.bfloat16)


def run_routed(moe: nn.Module, path: str, xs: torch.Tensor, starts: torch.Tensor,
               grouped_mm=None, *, groups_of_rows: torch.Tensor,
               tokens: int | None = None, stack=None) -> torch.Tensor | None:
    """Routed experts over the expert-sorted bf16 rows xs [N, H] -> bf16 [N, H]; None when
    this call should take the loop (padded_bmm with too much padding). starts [E']: each
    group's first row (groups of stacked_weights); groups_of_rows [N]: each row's group
    (sorted). tokens: the call's token count (padded_bmm pads to it when small).
    grouped_mm: the grouped GEMM to call (default torch._grouped_mm; tests pass the
    emulation). stack: stacked_weights(moe), when the caller has it."""
    w13, w2 = stack if stack is not None else stacked_weights(moe)
    E, inter = w13.shape[0], w2.shape[2]
    limit = moe.experts[0].limit
    N = xs.shape[0]
    if path == "grouped_mm":
        gmm = grouped_mm or torch._grouped_mm
        offs = torch.cat((starts[1:], starts.new_tensor([N]))).to(torch.int32)   # group ends
        h = gmm(xs, transposed(w13), offs=offs)                      # [N, 2I]
        return gmm(_swiglu(h, inter, limit), transposed(w2), offs=offs)
    if path != "padded_bmm":
        raise ValueError(f"unknown MoE path {path!r} (one of {MOE_PATHS})")
    if xs.device.type == "cpu" and N < E:
        # Fewer rows than groups (a decode step): each row's own expert weights, gathered
        # from float32 copies (gemm.cpu_f32), one bmm per projection.
        f13, f2 = cpu_f32(moe, "w13", w13), cpu_f32(moe, "w2", w2)
        if f13 is not None and f2 is not None:
            h = torch.bmm(xs.float()[:, None, :],
                          f13.index_select(0, groups_of_rows).transpose(1, 2))
            y = torch.bmm(_swiglu(h, inter, limit).float(),
                          f2.index_select(0, groups_of_rows).transpose(1, 2))
            return y.view(N, -1).to(torch.bfloat16)
    if tokens is not None and tokens <= STATIC_CAP_TOKENS:
        cap = max(tokens, 1)           # no group holds more rows than there are tokens
    else:
        counts = torch.diff(starts, append=starts.new_tensor([N]))
        cap = bucket(int(counts.max())) if N else 1
        if E * cap > 2 * max(N, 1) + 16:
            return None
    slot = torch.arange(N, device=xs.device) - starts.index_select(0, groups_of_rows) \
        + groups_of_rows * cap
    buf = xs.new_zeros(E * cap, xs.shape[1]).index_copy_(0, slot, xs)
    h = torch.bmm(buf.view(E, cap, -1), transposed(w13))              # [E, cap, 2I]
    y = torch.bmm(_swiglu(h, inter, limit), transposed(w2))          # [E, cap, H]
    return y.view(E * cap, -1).index_select(0, slot)
