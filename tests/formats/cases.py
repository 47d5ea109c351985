"""Inputs that stress the codecs: rounding boundaries, scales from tiny to huge, zeros."""
from __future__ import annotations

import math

import torch

from dsv41.formats import reference as ref


def _midpoints(grid) -> list[float]:
    return [(a + b) / 2 for a, b in zip(grid, grid[1:])]


def boundary_values(grid, top: float) -> torch.Tensor:
    """Every grid point and midpoint, one float32 ulp either side of each, both signs,
    all within [-top, top] so a block holding `top` keeps a unit scale."""
    pts = torch.tensor(list(grid) + _midpoints(grid), dtype=torch.float32)
    up = torch.nextafter(pts, torch.full_like(pts, math.inf))
    down = torch.nextafter(pts, torch.full_like(pts, -math.inf)).clamp(min=0)
    v = torch.cat([pts, up, down])
    v = v[v <= top]
    return torch.cat([v, -v])


def blocks_with_unit_scale(values: torch.Tensor, block: int, top: float) -> torch.Tensor:
    """Blocks whose first element is `top` (so the scale is exactly 1), the rest `values`."""
    per = block - 1
    n = -(-values.numel() // per)
    pad = torch.zeros(n * per - values.numel())
    body = torch.cat([values, pad]).reshape(n, per)
    return torch.cat([torch.full((n, 1), top), body], dim=1)


def scaled_random(gen: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    """Gaussian rows, each at its own scale from 1e-44 to 1e37, plus heavy tails."""
    x = torch.randn(rows, dim, generator=gen)
    exps = torch.randint(-44, 38, (rows, 1), generator=gen).float()
    x = x * torch.pow(10.0, exps)
    spikes = torch.rand(rows, dim, generator=gen) < 0.01
    return torch.where(spikes, x * 50, x)


def special_blocks(block: int) -> torch.Tensor:
    """Zero, negative-zero, tiny, subnormal, huge and mixed blocks."""
    f = torch.finfo(torch.float32)
    rows = [
        torch.zeros(block),
        -torch.zeros(block),
        torch.full((block,), -1e-45),             # smallest subnormal, negative
        torch.full((block,), f.tiny / 3),         # subnormal
        torch.full((block,), f.max),              # largest finite
        torch.linspace(-f.max, f.max, block),
        torch.cat([torch.tensor([1e30]), torch.full((block - 1,), -1e-30)]),  # tiny under a huge amax
        torch.cat([torch.tensor([-0.0, 0.0]), torch.full((block - 2,), 2.0**-130)]),
        torch.tensor([2.0 ** (k % 20 - 10) * (-1) ** k for k in range(block)]),
    ]
    return torch.stack(rows)


def nonfinite_blocks(block: int) -> torch.Tensor:
    rows = []
    for bad in (math.nan, math.inf, -math.inf):
        r = torch.linspace(-3, 3, block)
        r[block // 3] = bad
        rows.append(r)
    return torch.stack(rows)


E2M1_BOUNDARY = boundary_values(ref.E2M1_GRID, ref.E2M1_MAX)
E4M3_BOUNDARY = boundary_values(ref.E4M3_GRID, ref.E4M3_MAX)
