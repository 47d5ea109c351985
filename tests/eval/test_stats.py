"""Divergence, percentiles and the bootstrap."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv41.eval.stats import bootstrap_ci, divergence, first_diff, kl_divergence, latency_summary, percentile


def test_kl_matches_the_definition():
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    want = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert kl_divergence(p.log(), q.log()) == pytest.approx(want, rel=1e-12)
    # logits are unnormalized: a shift changes nothing
    assert kl_divergence(p.log() + 3.0, q.log() - 1.0) == pytest.approx(want, rel=1e-12)
    x = torch.randn(256)
    assert kl_divergence(x, x.clone()) == 0.0
    with pytest.raises(ValueError, match="shapes"):
        kl_divergence(torch.zeros(3), torch.zeros(4))


def test_first_diff():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2      # stopped early
    assert first_diff([], []) is None


def test_divergence_only_over_aligned_steps():
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(32, generator=g) for _ in range(4)]
    same = [t.clone() for t in ref]
    d = divergence([1, 2, 3, 4], ref, [1, 2, 3, 4], same)
    assert d["kl_mean"] == 0.0 and d["top1"] == 1.0 and d["exact_match"] and d["first_diff"] is None
    assert d["aligned_steps"] == 4 and d["logits_equal"]
    other = [ref[0] + 0.1 * torch.randn(32, generator=g), ref[1].clone(),
             torch.randn(32, generator=g), torch.randn(32, generator=g)]
    d = divergence([1, 2, 3, 4], ref, [1, 9, 3, 4], other)
    # steps 0 and 1 are aligned (the histories agree up to the first differing token)
    assert d["first_diff"] == 1 and d["aligned_steps"] == 2 and not d["exact_match"]
    k0 = kl_divergence(ref[0], other[0])
    assert d["kl_first"] == k0 > 0 and d["kl_mean"] == pytest.approx(k0 / 2) and d["kl_max"] == k0
    assert not d["logits_equal"]
    with pytest.raises(ValueError):
        divergence([], [], [], [])


def test_percentiles():
    v = list(range(1, 101))
    assert percentile(v, 50) == pytest.approx(50.5) and percentile([], 50) is None
    s = latency_summary([0.1, 0.2, 0.3])
    assert s["count"] == 3 and s["p50"] == pytest.approx(0.2) and s["max"] == 0.3
    assert latency_summary([])["p99"] is None


def test_bootstrap():
    rng = np.random.default_rng(1)
    x = rng.normal(5.0, 1.0, size=50)
    ci = bootstrap_ci(x, "mean", confidence=0.95, n_boot=2000, seed=0)
    assert ci["lo"] < x.mean() < ci["hi"] and ci["n"] == 50
    # the interval is about +-1.96 standard errors wide
    se = x.std(ddof=1) / math.sqrt(50)
    assert 2.5 * se < ci["hi"] - ci["lo"] < 5.5 * se
    assert bootstrap_ci(x, "mean", seed=0) == bootstrap_ci(x, "mean", seed=0)        # deterministic
    assert bootstrap_ci([0.0, 0.0, 0.0], "max") == {"n": 3, "value": 0.0, "lo": 0.0, "hi": 0.0}
    assert bootstrap_ci([], "mean")["value"] is None
    wide = bootstrap_ci(x, "mean", confidence=0.99, seed=0)
    assert wide["hi"] - wide["lo"] > ci["hi"] - ci["lo"]
    with pytest.raises(ValueError, match="statistic"):
        bootstrap_ci(x, "mode")
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, float("nan")], "mean")
