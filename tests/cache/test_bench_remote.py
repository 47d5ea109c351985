"""bench/bench_remote.py runs end to end at a toy size (it starts and stops its own local
Mooncake and Redis servers) and writes a well-formed report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..remote_env import missing

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_remote.py"


def test_bench_remote_smoke(tmp_path):
    why = missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "remote.json"
    subprocess.run([sys.executable, str(BENCH), "--blocks", "4", "--batch", "2", "--repeat", "1",
                    "--prefixes", "64", "--suffix", "8", "--json", str(out)],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.read_text())
    assert report["io"] and all(set(b["backends"]) == {"blocks", "snapshots"} for b in report["io"])
    for b in report["io"]:
        for v in b["backends"].values():
            assert all(r > 0 for r in v["tier_over_raw"].values())
    (row,) = report["resume_ttft"]
    assert row["prefix_tokens"] == 64 and row["same_first_token"]
    assert row["cold"]["path"] == "cold" and row["remote"]["global_hit_tokens"] > 0
