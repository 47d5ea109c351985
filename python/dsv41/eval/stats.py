"""Divergence, latency and interval statistics.

Divergence of a run from the full-prefill reference (same prompt, same sampling seed):
  - per generated step t, the next-token distributions p_ref(t) and p(t) are comparable
    only while both runs have generated the same tokens before t; the aligned steps are
    0 .. d where d is the first differing generated token (or every step if none differs).
  - kl_first: KL(p_ref || p) at step 0 (the prompt's last position; always aligned).
  - kl_mean / kl_max: over the aligned steps. top1: fraction of aligned steps whose argmax
    agrees. first_diff: d, or None when the outputs are identical.
KL is computed in float64 from the logits (log_softmax), so identical logits give exactly 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["kl_divergence", "divergence", "first_diff", "percentile", "latency_summary",
           "bootstrap_ci"]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(softmax(ref) || softmax(other)) in nats, float64; 0.0 for identical inputs."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    lp = torch.log_softmax(ref_logits.detach().double().cpu(), dim=-1)
    lq = torch.log_softmax(logits.detach().double().cpu(), dim=-1)
    kl = float(torch.sum(lp.exp() * (lp - lq)))
    return max(kl, 0.0)


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter
    end); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(ref_tokens: Sequence[int], ref_logits: Sequence[torch.Tensor],
               tokens: Sequence[int], logits: Sequence[torch.Tensor]) -> dict:
    """See the module docstring. logits: one [vocab] tensor per generated token."""
    if not ref_logits or not logits:
        raise ValueError("divergence needs the logits of at least one generated step on both sides")
    d = first_diff(ref_tokens, tokens)
    last = min(len(ref_logits), len(logits)) - 1
    upto = last if d is None else min(d, last)
    kls = [kl_divergence(ref_logits[t], logits[t]) for t in range(upto + 1)]
    top1 = [int(torch.argmax(ref_logits[t])) == int(torch.argmax(logits[t])) for t in range(upto + 1)]
    return {"kl_first": kls[0], "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)),
            "top1": float(np.mean(top1)), "aligned_steps": upto + 1, "first_diff": d,
            "exact_match": d is None,
            "logits_equal": all(torch.equal(ref_logits[t], logits[t]) for t in range(upto + 1))}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_summary(values: Sequence[float]) -> dict:
    """count, mean, p50, p95, p99, max of latencies in seconds."""
    v = list(values)
    return {"count": len(v), "mean": float(np.mean(v)) if v else None,
            "p50": percentile(v, 50), "p95": percentile(v, 95), "p99": percentile(v, 99),
            "max": float(np.max(v)) if v else None}


_STATS = {
    "mean": lambda x: float(np.mean(x)),
    "median": lambda x: float(np.median(x)),
    "max": lambda x: float(np.max(x)),
    "min": lambda x: float(np.min(x)),
    "p50": lambda x: float(np.percentile(x, 50)),
    "p95": lambda x: float(np.percentile(x, 95)),
    "p99": lambda x: float(np.percentile(x, 99)),
}


def stat_names() -> list[str]:
    return list(_STATS)


def bootstrap_ci(values: Sequence[float], stat: str = "mean", *, confidence: float = 0.95,
                 n_boot: int = 2000, seed: int = 0) -> dict:
    """Percentile bootstrap interval of stat over the values (one per prompt): resample the
    values with replacement n_boot times. Returns {"n", "value", "lo", "hi"}; with one
    value (or all values equal) the interval collapses to the value."""
    if stat not in _STATS:
        raise ValueError(f"unknown statistic {stat!r}; one of {', '.join(_STATS)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "value": None, "lo": None, "hi": None}
    if np.any(~np.isfinite(x)):
        raise ValueError("bootstrap values must be finite")
    f = _STATS[stat]
    value = f(x)
    if x.size == 1 or np.all(x == x[0]):
        return {"n": int(x.size), "value": value, "lo": value, "hi": value}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    samples = np.array([f(x[i]) for i in idx])
    a = (1 - confidence) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return {"n": int(x.size), "value": value, "lo": float(min(lo, value)), "hi": float(max(hi, value))}
