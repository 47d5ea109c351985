"""The benchmark driver runs end to end (tiny sizes) and writes its JSON report."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_model.py"


def test_bench_model_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_model", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "v41-tiny", "--lengths", "24", "48", "--decode-steps", "2",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["length"] for r in report["results"]] == [24, 48]
    for row in report["results"]:
        for mode in ("sparse", "dense"):
            assert row[mode]["prefill_tokens_per_s"] > 0 and row[mode]["finite"]
            assert row[mode]["decode_steps"] == 2 and row[mode]["decode_tokens_per_s"] > 0
        assert row["prefill_speedup"] > 0
    assert set(report["prefill_growth"]) == {"sparse", "dense"}
    assert "sparse vs dense" in capsys.readouterr().out
