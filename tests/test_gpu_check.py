"""scripts/gpu_check.sh, the one-call GPU run: a dry run on a machine without a GPU must end
at once with the no-GPU verdict and still bring back its three files (the device tool
returns at most 8 files of $OUT), and the summary must mark what died without a result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_report  # noqa: E402


@pytest.mark.no_gpu
def test_dry_run_without_a_gpu_writes_the_verdict_and_the_archive(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DSV41_PYTHON": sys.executable, "DSV41_GPU_CHECK_SECONDS": "120"}
    p = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), str(out)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stdout + p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["gpu_check.json", "gpu_check_logs.tar.gz",
                                                     "gpu_check_steps.log"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["verdict"] == "no_gpu"
    assert summary["gpu"]["devices"] == 0
    assert summary["smoke"] == {} and summary["benchmarks"] == {}  # nothing was built or run
    assert "no CUDA GPU visible" in (out / "gpu_check_steps.log").read_text()
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"steps.log", "gpu_visible.log", "gpu_visible.rc", "verdict"} <= names


def test_report_marks_a_case_that_died_without_a_result(tmp_path):
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke_topk.rc").write_text("0\n")
    (tmp_path / "smoke" / "topk.json").write_text(json.dumps({"case": "topk", "ok": True}))
    (tmp_path / "smoke_attention_mma.rc").write_text("139\n")
    (tmp_path / "smoke_attention_mma.log").write_text("Segmentation fault\n")
    (tmp_path / "bench_copy.rc").write_text("skipped\n")
    s = gpu_check_report.summarize(tmp_path)
    assert s["verdict"] == "fail"
    assert s["failed_steps"] == ["smoke_attention_mma"] and s["skipped_steps"] == ["bench_copy"]
    assert s["smoke"]["topk"]["ok"] is True
    assert s["smoke"]["attention_mma"]["ok"] is False and "139" in s["smoke"]["attention_mma"]["error"]


def test_smoke_cases_list_every_kernel():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    listed = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_smoke.py"), "--list"], env=env,
                            capture_output=True, text=True, timeout=120).stdout.split()
    assert {"attention_mma", "attention_wgmma", "topk", "indexer_scores", "copy_blocks_copy_engine",
            "scatter_nvfp4", "codecs_fp8_swa", "crc32c_device"} <= set(listed)


@pytest.mark.no_gpu
def test_smoke_cases_fail_cleanly_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_smoke.py"), "topk"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and json.loads(p.stdout) == {"case": "topk", "ok": False, "error": "no CUDA GPU visible"}
