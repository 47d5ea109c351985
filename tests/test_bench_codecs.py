"""bench/bench_codecs.py runs end to end at a toy size and writes a well-formed report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_codecs.py"


def test_bench_codecs_smoke(tmp_path):
    out = tmp_path / "codecs.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--rows", "64", "--repeat", "1",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {(r["codec"], r["op"]) for r in rows} == {
        (c, op) for c in ("nvfp4", "mxfp4", "fp8_swa", "fp8_v4") for op in ("quantize", "dequantize")}
    assert all(r["op_s"] > 0 and r["reference_s"] > 0 and r["values"] == 64 * 512 for r in rows)
    assert report["build"]["torch_version"]
