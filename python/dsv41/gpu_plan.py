"""GPU memory plan: weights as stored, the KV budget left, and what it holds (`dsv41 plan`).

Weight bytes come from the model itself built on the meta device (no memory), each tensor
counted at the precision the checkpoint ships it (`StoredFormat`): DeepSeek's V4/V4.1
releases keep dense Linears in FP8 E4M3 with one UE8M0 scale byte per 128x128 block and
routed experts in packed FP4 (two codes a byte) with one UE8M0 scale byte per 32 inputs;
the embedding, head, norms and router in bf16; mHC parameters, attention sinks and the
compressors' position bias in float32; hash-routing tables as int64. The production path
(model/production.py) holds exactly these bytes. KV bytes per token and per sequence come
from dsv41.budget (formats.layout). Weights are split evenly over the GPUs (expert and
tensor parallel; the several-GPU runtime is a later issue), each GPU keeps `reserve` bytes
for activations, workspace and the CUDA context, and the rest is KV budget.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .budget import kv_budget
from .config import ModelConfig

__all__ = ["MemoryPlan", "StoredFormat", "format_plan", "memory_plan", "weight_bytes"]

H200_BYTES = 141 * 10**9
DEFAULT_RESERVE = 10 * 10**9
_FLOAT32_NAMES = ("hc_", "attn_sink", ".ape")


@dataclass(frozen=True)
class StoredFormat:
    """How a checkpoint stores its Linear weights: dense "fp8" or "bf16", experts "fp4",
    "fp8" or "bf16"; scales are UE8M0 bytes (DeepSeek's V4 release)."""

    dense: str = "fp8"
    experts: str = "fp4"
    block: int = 128
    fp4_block: int = 32
    scale_bytes: int = 1

    @classmethod
    def for_config(cls, config: ModelConfig, quantization_config: dict | None = None
                   ) -> StoredFormat:
        """From the formats a checkpoint's config.json states (`model.weights.
        read_quantization`); without any, the full-size presets (`*-flash`) are DeepSeek's
        FP8 + FP4 release and the others bf16."""
        q = quantization_config
        if q is None:
            return cls() if config.name.endswith("flash") else cls("bf16", "bf16")
        if not q:
            return cls("bf16", "bf16")
        block = int((q.get("weight_block_size") or [128, 128])[0])
        experts = str(q.get("expert_dtype") or "fp8").lower()
        return cls(str(q.get("dense_dtype") or "fp8"), experts, block)

    def linear_bytes(self, out_dim: int, in_dim: int, fmt: str) -> int:
        if fmt == "bf16":
            return 2 * out_dim * in_dim
        if fmt == "fp8":
            scales = math.ceil(out_dim / self.block) * math.ceil(in_dim / self.block)
            return out_dim * in_dim + scales * self.scale_bytes
        if fmt == "fp4":
            return out_dim * in_dim // 2 + out_dim * (in_dim // self.fp4_block) * self.scale_bytes
        raise ValueError(f"unknown weight format {fmt!r} (bf16, fp8, fp4)")


def weight_bytes(config: ModelConfig, fmt: StoredFormat) -> dict[str, int]:
    """Stored bytes of the model's tensors by kind (experts, dense, other), counted over
    the model built on the meta device."""
    import torch

    from .model import Model
    from .model.layers import Linear
    with torch.device("meta"):
        model = Model(config)
    out = {"experts": 0, "dense": 0, "other": 0}
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Linear)}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        lin = linears.get(name)
        if lin is not None and name != "head.weight":
            kind = "experts" if ".experts." in name else "dense"
            out[kind] += fmt.linear_bytes(lin.out_features, lin.in_features,
                                          fmt.experts if kind == "experts" else fmt.dense)
        elif not t.is_floating_point():
            out["other"] += t.numel() * t.element_size()
        else:
            out["other"] += t.numel() * (4 if any(s in name for s in _FLOAT32_NAMES) else 2)
    return out


@dataclass(frozen=True)
class MemoryPlan:
    name: str
    gpus: int
    gpu_memory_bytes: int
    reserve_bytes: int
    stored_format: dict[str, Any]
    weight_bytes: dict[str, int]
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    fits: bool
    global_kv_bytes_per_token: float
    global_kv_tokens_per_gpu: int
    swa_state_bytes_per_session: int
    swa_sessions_per_gpu: int
    context_tokens: int
    sessions_at_context_per_gpu: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_plan(config: ModelConfig, *, gpus: int = 1, gpu_memory_bytes: int = H200_BYTES,
                reserve_bytes: int = DEFAULT_RESERVE, fmt: StoredFormat | None = None,
                context_tokens: int = 32768) -> MemoryPlan:
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    if gpu_memory_bytes <= reserve_bytes:
        raise ValueError(f"GPU memory ({gpu_memory_bytes} B) must exceed the reserve "
                         f"({reserve_bytes} B)")
    fmt = fmt or StoredFormat.for_config(config)
    wb = weight_bytes(config, fmt)
    total = sum(wb.values())
    per_gpu = math.ceil(total / gpus)
    left = gpu_memory_bytes - reserve_bytes - per_gpu
    kv = kv_budget(config)
    swa = kv.swa_bytes_per_sequence + kv.compressor_state_bytes_per_sequence
    budget = max(left, 0)
    at_ctx = swa + context_tokens * kv.global_bytes_per_token
    return MemoryPlan(
        name=config.name, gpus=gpus, gpu_memory_bytes=gpu_memory_bytes,
        reserve_bytes=reserve_bytes, stored_format=asdict(fmt), weight_bytes=wb,
        weight_bytes_total=total, weight_bytes_per_gpu=per_gpu, kv_budget_bytes_per_gpu=left,
        fits=left > 0, global_kv_bytes_per_token=kv.global_bytes_per_token,
        global_kv_tokens_per_gpu=int(budget // kv.global_bytes_per_token),
        swa_state_bytes_per_session=swa, swa_sessions_per_gpu=budget // swa,
        context_tokens=context_tokens, sessions_at_context_per_gpu=int(budget // at_ctx))


def format_plan(p: MemoryPlan) -> str:
    gb = 1e9
    f = p.stored_format
    lines = [
        (f"{p.name} on {p.gpus} GPU(s) of {p.gpu_memory_bytes / gb:.0f} GB "
         f"(reserve {p.reserve_bytes / gb:.0f} GB each for activations/workspace)"),
        (f"  weights as stored (dense {f['dense']}, experts {f['experts']}): "
         f"{p.weight_bytes_total / gb:.2f} GB total = experts "
         f"{p.weight_bytes['experts'] / gb:.2f} + dense {p.weight_bytes['dense'] / gb:.2f} "
         f"+ other {p.weight_bytes['other'] / gb:.2f}"),
        f"  weights per GPU (even split): {p.weight_bytes_per_gpu / gb:.2f} GB",
    ]
    if not p.fits:
        need = math.ceil(p.weight_bytes_total / (p.gpu_memory_bytes - p.reserve_bytes))
        lines.append(f"  DOES NOT FIT: {-p.kv_budget_bytes_per_gpu / gb:.2f} GB short per GPU;"
                     f" at least {need} GPUs needed for the weights alone")
        return "\n".join(lines)
    lines += [
        f"  KV budget left per GPU: {p.kv_budget_bytes_per_gpu / gb:.2f} GB",
        (f"  global KV at {p.global_kv_bytes_per_token:.1f} B/token: "
         f"{p.global_kv_tokens_per_gpu:,} tokens per GPU"),
        (f"  SWA + compressor state {p.swa_state_bytes_per_session:,} B/session: "
         f"{p.swa_sessions_per_gpu:,} sessions per GPU (SWA state only)"),
        (f"  sessions of {p.context_tokens:,} tokens (global KV + SWA state): "
         f"{p.sessions_at_context_per_gpu:,} per GPU"),
    ]
    return "\n".join(lines)
