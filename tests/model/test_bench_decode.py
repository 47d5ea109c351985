"""bench/bench_decode.py runs end to end at tiny sizes and reports what issue 27's CPU proxy
asks: the paged step's ops, launches and host syncs against the per-sequence step's."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_decode.py"
sys.path.insert(0, str(BENCH.parent))            # the bench's own helpers (_meta)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_smoke(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert _bench().main(["--preset", "v41-tiny", "--batches", "1", "4", "--context", "70",
                          "--steps", "2", "--chunk", "32", "--prefill-lengths", "50",
                          "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["preset"] == "v41-tiny" and [r["batch"] for r in report["batches"]] == [1, 4]
    for row in report["batches"]:
        assert len(row["paged_ms"]) == 2 and len(row["reference_ms"]) == 5
        assert row["paged_ops"]["host_syncs"] == 0          # no sync inside a paged step
        assert row["reference_ops"]["host_syncs"] >= row["batch"]
        assert row["ratio_paged_vs_reference"] > 0
    one, four = report["batches"]
    assert four["ops_ratio_vs_batch1"] <= 1.25          # a step's ops do not grow with B
    assert four["reference_ops"]["ops"] > 1.5 * one["reference_ops"]["ops"]   # it grows
    assert report["prefill"][0]["tokens"] == 50 and report["prefill"][0]["tokens_per_s"] > 0
    assert "batch 4: paged" in capsys.readouterr().out


def test_bench_decode_refuses_a_flash_width_model_too_small():
    with pytest.raises(SystemExit, match="at least 3 layers"):
        _bench().main(["--flash-layers", "2", "--device", "cpu"])
