"""scripts/gpu_model.py, gpu_check.sh's model step: its token comparison, its Flash-width
model, and one end-to-end run at a toy size on the CPU (the device run is the GPU check's)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_model  # noqa: E402

from dsv41 import Model, ModelConfig  # noqa: E402


def _logits(*rows) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def test_compare_excuses_only_near_ties():
    cpu = _logits([0.0, 5.0, 1.0], [3.0, 2.9995, 0.0], [0.0, 1.0, 4.0])
    dev = _logits([0.0, 5.0, 1.0], [2.9995, 3.0, 0.0], [0.0, 4.5, 4.0])
    c = gpu_model.compare(cpu, dev, tie_margin=1e-3)
    assert c["top1_agree"] == 1 / 3 and not c["greedy_tokens_equal"]
    assert [(m["step"], m["near_tie"]) for m in c["mismatches"]] == [(1, True), (2, False)]
    assert c["unexcused_mismatches"] == 1 and c["max_abs_logit_diff"] == 3.5
    same = gpu_model.compare(cpu, cpu, tie_margin=1e-3)
    assert same["greedy_tokens_equal"] and same["unexcused_mismatches"] == 0


def test_flash_width_keeps_flash_dimensions_on_few_layers():
    cfg = gpu_model.flash_width(4, 8)
    flash = ModelConfig.preset("v41-flash")
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == \
        (flash.hidden_size, flash.num_heads, flash.head_dim, flash.vocab_size)
    assert cfg.compress_ratios == (0, 2, 1, 1) and cfg.n_routed_experts == 8
    with torch.device("meta"):
        n = sum(p.numel() for p in Model(cfg).parameters())
    assert 3.0e9 < n < 3.3e9
    # The 8-layer, 16-expert model of the first GPU run: 7.18B parameters.
    with torch.device("meta"):
        n8 = sum(p.numel() for p in Model(gpu_model.flash_width(8, 16)).parameters())
    assert round(n8 / 1e9, 2) == 7.18


def test_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "tiny.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_model.py"), "--preset", "v41-tiny",
                        "--device", "cpu", "--prompt", "8", "--steps", "2", "--timing-prompt", "8",
                        "--timing-steps", "1", "--timing-paths", "bf16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["ok"] and set(r["paths"]) == {"reference", "bf16"} and len(r["cpu_reference"]["tokens"]) == 3
    assert r["paths"]["reference"]["tokens_must_match"] and not r["paths"]["bf16"]["tokens_must_match"]
    assert r["paths"]["bf16"]["timing"]["decode_ms_per_token_median"] > 0
    assert "timing" not in r["paths"]["reference"]
