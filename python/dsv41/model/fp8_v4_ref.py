"""DeepSeek-V4's FP8 main-KV entry in torch: the model's stand-in until the byte-exact
codec (`dsv41.formats` quantize_fp8_v4 / dequantize_fp8_v4, csrc, CUDA) lands.

MERGE NOTE: `encode` / `decode` below are the only two functions to replace with the
codec op; `model/kv_codec.py` (`FP8V4Codec`) is their only caller.

Entry layout (SPEC section 2b; FlashMLA "MODEL1" sparse FP8): for head_dim D with R RoPE
dims and N = D - R no-RoPE dims (V4-Flash: 448 + 64):
  [N bytes E4M3 of the no-RoPE dims | 2R bytes bf16 RoPE dims | N/64 UE8M0 scales | pad]
padded to a multiple of 8 bytes (V4-Flash: 448 + 128 + 7 + 1 = 584). Per block of 64
no-RoPE dims: s = the smallest power of two >= fl32(amax / 448) (amax == 0 gives 2^-127),
stored as UE8M0 (biased exponent, 127 = 2^0); q_i = E4M3_rne(x_i / s) saturated to 448.
The RoPE dims are bf16 (round to nearest even).
"""
from __future__ import annotations

import torch

from ..formats import layout

__all__ = ["BLOCK", "decode", "encode"]

BLOCK = 64
_E4M3_MAX = 448.0


def _pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, UE8M0 exponent byte) of the smallest power of two >= amax/448."""
    ratio = (amax.float() / _E4M3_MAX).double()
    mant, exp = torch.frexp(ratio)           # ratio = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    e = torch.where(ratio > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(ratio), e).float(), (e + 127).to(torch.uint8)


def encode(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [n, D] float32 -> entries uint8 [n, fp8_v4_main_bytes(D - R, R)]."""
    n, D = x.shape
    nope = D - rope_dim
    size = layout.fp8_v4_main_bytes(nope, rope_dim)
    blocks = x[:, :nope].float().reshape(n, nope // BLOCK, BLOCK)
    scale, code = _pow2_scale(blocks.abs().amax(-1))
    q = (blocks / scale[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    rope = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out = torch.zeros(n, size, dtype=torch.uint8, device=x.device)
    out[:, :nope] = q.reshape(n, nope).view(torch.uint8)
    out[:, nope:nope + 2 * rope_dim] = rope.reshape(n, 2 * rope_dim)
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // BLOCK] = code
    return out


def decode(entries: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """entries uint8 [n, bytes] -> float32 [n, head_dim]."""
    n = entries.shape[0]
    nope = head_dim - rope_dim
    q = entries[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    code = entries[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // BLOCK]
    scale = torch.ldexp(torch.ones(code.shape, dtype=torch.float32, device=entries.device),
                        code.to(torch.int32) - 127)
    values = (q.reshape(n, nope // BLOCK, BLOCK) * scale[..., None]).reshape(n, nope)
    rope = entries[:, nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat((values, rope.reshape(n, rope_dim)), 1)
