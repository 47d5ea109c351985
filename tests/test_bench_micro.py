"""The pytest-benchmark microbenchmarks (bench/micro/) still run: each one once, untimed
(--benchmark-disable), in a subprocess. Their timings are not part of CI (noisy); this
only checks that every benchmark and its reference still work against the current code."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_microbenchmarks_run_once():
    pytest.importorskip("pytest_benchmark")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "bench/micro", "-q", "-p", "no:cacheprovider",
                        "--benchmark-disable", "-x"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
