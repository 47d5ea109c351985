"""bench/bench_cache.py runs end to end at a toy size and writes a well-formed report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_cache.py"


def test_bench_cache_store_smoke_into_a_new_dir(tmp_path):
    """--dir may name a folder that does not exist yet (issue 29 item 5: it failed with
    FileNotFoundError): it is made, like a store's directory, and the run measures there."""
    out, disk = tmp_path / "cache.json", tmp_path / "new" / "disk"
    p = subprocess.run([sys.executable, str(BENCH), "--only", "store", "--store-mb", "1", "--chain-tokens", "256",
                        "--repeat", "1", "--preset", "v41-tiny", "--block-tokens", "16", "--dir", str(disk),
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["args"]["dir"] == str(disk) and disk.is_dir()
    assert report["store"] and list(disk.iterdir()) == []  # its stores are removed again
