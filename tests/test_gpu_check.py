"""scripts/gpu_check.sh, the one-call GPU run: a dry run on a machine without a GPU must end
at once with the no-GPU verdict and still bring back its three files (the device tool
returns at most 8 files of $OUT), and the summary must mark what died without a result."""
from __future__ import annotations

import json
import os
import re
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


def _junit(path: Path, tests: int, failures: int = 0, skipped: int = 0) -> None:
    cases = "".join(f'<testcase classname="t" name="c{i}"/>' for i in range(tests - failures - skipped))
    cases += "".join(f'<testcase classname="t" name="f{i}"><failure message="boom"/></testcase>' for i in range(failures))
    cases += "".join(f'<testcase classname="t" name="s{i}"><skipped message="why"/></testcase>' for i in range(skipped))
    path.write_text(f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" '
                    f'skipped="{skipped}">{cases}</testsuite></testsuites>')


def _work(tmp_path: Path, files: dict) -> Path:
    """A gpu_check work folder whose expected test files ended as `files` says: name ->
    (rc, tests, failures, skipped), or (rc,) for a process that wrote no report."""
    (tmp_path / "pytest").mkdir()
    (tmp_path / "pytest" / "expected.txt").write_text("".join(f"{n}\n" for n in files))
    for name, outcome in files.items():
        (tmp_path / f"pytest_{name}.rc").write_text(f"{outcome[0]}\n")
        if len(outcome) > 1:
            _junit(tmp_path / "pytest" / f"{name}.xml", *outcome[1:])
    return tmp_path


def test_verdict_passes_only_when_every_gpu_test_file_ran_and_passed(tmp_path):
    s = gpu_check_report.summarize(_work(tmp_path, {"test_codecs": (0, 5, 0, 1), "test_gpu": (0, 3, 0, 0)}))
    assert (s["verdict"], s["verdict_reasons"]) == ("pass", [])
    assert s["tests_expected"] == ["test_codecs", "test_gpu"]


@pytest.mark.parametrize("outcome,why", [
    ((1, 5, 2, 0), "2 failed"),
    (("skipped",), "not run (deadline)"),
    ((139,), "no JUnit report"),           # a segfault: the first GPU run's failure
    ((0, 4, 0, 4), "no test passed"),      # every test skipped: nothing was checked
])
def test_verdict_fails_for_a_test_file_that_did_not_run_and_pass(tmp_path, outcome, why):
    s = gpu_check_report.summarize(_work(tmp_path, {"test_codecs": (0, 5, 0, 0), "test_gpu": outcome}))
    assert s["verdict"] == "fail"
    assert any(r.startswith("test_gpu: ") and why in r for r in s["verdict_reasons"]), s["verdict_reasons"]


def test_report_inlines_the_toolchain_model_runs_and_an_absent_benchmark(tmp_path):
    work = _work(tmp_path, {"test_build": (0, 2, 0, 0)})
    (work / "toolchain.json").write_text(json.dumps({"ok": True, "libstdcxx_loaded": "/lib/libstdc++.so.6"}))
    (work / "build_check.rc").write_text("0\n")
    (work / "model").mkdir()
    (work / "model" / "v41_small.json").write_text(json.dumps({"ok": True, "paths": {}}))
    (work / "model_v41_small.rc").write_text("0\n")
    (work / "model_flash_width.rc").write_text("124\n")  # hit its cap before writing a report
    (work / "bench").mkdir()
    (work / "bench" / "decode.json").write_text(json.dumps({"benchmark": "decode", "skipped": "not in this tree"}))
    s = gpu_check_report.summarize(work)
    assert s["toolchain"]["libstdcxx_loaded"] == "/lib/libstdc++.so.6"
    assert s["model"]["v41_small"]["ok"] is True
    assert s["model"]["flash_width"]["ok"] is False and "124" in s["model"]["flash_width"]["error"]
    assert s["benchmarks"]["decode"]["skipped"] == "not in this tree"
    assert s["verdict"] == "fail" and s["verdict_reasons"] == ["step model_flash_width failed (rc=124)"]


def test_every_gpu_marked_test_file_is_run_by_the_gpu_check():
    # A GPU test file missing from gpu_check.sh's list would never run anywhere.
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = set(re.findall(r"\btests/[\w/]+\.py\b", script))
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\b.*\bpytest\.mark\.gpu\b)|marks=pytest\.mark\.gpu\b",
                           p.read_text(), re.M)}
    assert marked and marked <= listed, sorted(marked - listed)
