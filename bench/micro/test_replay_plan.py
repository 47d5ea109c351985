"""The replay planner on a 64K-token prompt with a 60K-token global hit and no SWA
snapshot, per replay mode; "off" (recompute: the least work) is the baseline."""
from __future__ import annotations

import pytest

from dsv41.config import ModelConfig
from dsv41.replay import plan_prompt

N, HIT = 64 * 1024, 60 * 1024


@pytest.mark.parametrize("mode", ["off", "bounded", "exact"])
def test_replay_plan_64k(benchmark, mode):
    benchmark.group = "replay-plan-64k"
    cfg = ModelConfig.preset("v41-flash")
    plan = benchmark(plan_prompt, cfg, N, global_hit=HIT, replay=mode, align=64)
    assert plan.path == ("recompute" if mode == "off" else "encoder_replay")
    assert plan.prompt_tokens == N
