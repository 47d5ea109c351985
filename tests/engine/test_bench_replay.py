"""bench/bench_replay.py runs end to end at a toy size and its FLOP model is sane."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from bench_replay import main, prefill_flops  # noqa: E402

from dsv41.config import ModelConfig  # noqa: E402


def test_flop_ratio_bounds():
    c = ModelConfig.preset("v41-flash")
    W = c.sliding_window
    assert prefill_flops(c, W) == prefill_flops(c, W, 0)
    r = prefill_flops(c, 8192) / prefill_flops(c, 8192, 8192 - W)
    assert 1.5 < r < 2.0      # at most 2x: the decoder is half the layers


def test_bench_runs_tiny(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--preset", "v41-tiny", "--batch", "2", "--lengths", "40", "--prefixes", "32",
                 "--suffix", "8", "--block-tokens", "16", "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    row = res["decoder_replay_prefill"][0]
    assert row["measured_speedup"] > 0 and row["flop_ratio"] > 1
    t = res["ttft"][0]
    assert [t[k]["path"] for k in ("cold", "both_hit", "encoder_replay")] == ["cold", "both_hit", "encoder_replay"]
    assert t["encoder_replay"]["replayed_tokens"] == 16
