"""Summarize a scripts/gpu_check.sh work folder into one JSON file with everything inlined.

    python scripts/gpu_check_report.py WORK_DIR OUT_JSON

Reads what gpu_check.sh left in WORK_DIR (NAME.log / NAME.rc per step, toolchain.json,
smoke/*.json, model/*.json, bench/*.json, pytest/*.xml and pytest/expected.txt, clocks.csv,
verdict) and writes OUT_JSON: the verdict ("pass", "fail", "no_gpu", "build_failed") with
the reasons for anything but a pass, the device, the toolchain, every step's exit code and
tail, every smoke case's result, every model run, every benchmark's report, every test
file's counts and failed cases, the sanitizer error summaries and the sampled clocks.

The verdict is "pass" only when no step failed and every expected GPU test file ran (its
JUnit report exists and at least one of its tests passed) with no failure or error; a
file skipped for the deadline, or one that died before its report, fails it.
Exit code: 0 for "pass", 2 for "no_gpu", 1 otherwise. Standard library only (the GPU
machine's python may lack the project's packages).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _read(p: Path, limit: int | None = None) -> str | None:
    try:
        text = p.read_text(errors="replace")
    except OSError:
        return None
    return text if limit is None else text[-limit:]


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": f"{p.name}: {e}"}


def steps(work: Path) -> dict:
    out = {}
    for rc_file in sorted(work.glob("*.rc")):
        name = rc_file.stem
        rc = rc_file.read_text().strip()
        out[name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc,
                     "tail": _read(work / f"{name}.log", 1500)}
    return out


def junit(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no junit report ({e}): the process ended early (see its log)"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    t = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    t["passed"] = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
    t["failed_cases"] = {}
    t["skipped_reasons"] = {}
    for c in suite.iter("testcase"):
        case = f"{c.get('classname')}::{c.get('name')}"
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            t["failed_cases"][case] = (bad.get("message") or "")[:400]
        skip = c.find("skipped")
        if skip is not None:
            t["skipped_reasons"].setdefault((skip.get("message") or "")[:160], 0)
            t["skipped_reasons"][(skip.get("message") or "")[:160]] += 1
    return t


def sanitizer(log: str | None) -> dict:
    if log is None:
        return {}
    m = re.search(r"ERROR SUMMARY: (\d+) error", log)
    return {"errors": int(m.group(1)) if m else None,
            "first_errors": re.findall(r"=========\s+(Invalid .*|Race .*|.*hazard.*)", log)[:5]}


def clocks(path: Path) -> dict:
    text = _read(path)
    if not text:
        return {}
    sm, mem = [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            try:
                sm.append(float(parts[1].split()[0]))
                mem.append(float(parts[2].split()[0]))
            except (ValueError, IndexError):
                continue
    if not sm:
        return {"raw_tail": text[-500:]}
    return {"samples": len(sm), "sm_mhz_min": min(sm), "sm_mhz_max": max(sm), "sm_mhz_median": sorted(sm)[len(sm) // 2],
            "mem_mhz_min": min(mem), "mem_mhz_max": max(mem), "raw_tail": text[-2000:]}


def _results(work: Path, folder: str, st: dict, prefix: str) -> dict:
    """folder/*.json by name; a step `prefix + name` whose process died without writing
    its JSON gets an entry saying so (the JSON file names use '_' where the steps do)."""
    out = {p.stem: _json(p) for p in sorted((work / folder).glob("*.json"))}
    for name, s in st.items():
        if name.startswith(prefix) and name[len(prefix):] not in out:
            out[name[len(prefix):]] = {"ok": False, "error": f"process ended with rc={s['rc']} and wrote no result",
                                       "tail": s["tail"]}
    return out


def expected_tests(work: Path) -> list[str]:
    text = _read(work / "pytest" / "expected.txt") or ""
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_file_problem(name: str, st: dict, tests: dict) -> str | None:
    """Why an expected GPU test file does not count as run and passed (None: it does)."""
    rc = (st.get(f"pytest_{name}") or {}).get("rc")
    if rc is None:
        return f"{name}: not run"
    if rc == "skipped":
        return f"{name}: not run (deadline)"
    t = tests.get(name) or {}
    if "error" in t:
        return f"{name}: rc={rc}, no JUnit report (the process died: see its tail)"
    if t.get("failures") or t.get("errors"):
        return f"{name}: {t.get('failures', 0)} failed, {t.get('errors', 0)} errors"
    if not t.get("passed"):
        return f"{name}: no test passed ({t.get('skipped', 0)} skipped)"
    if rc != 0:
        return f"{name}: rc={rc}"
    return None


def verdict_of(work: Path, st: dict, tests: dict) -> tuple[str, list[str]]:
    """(verdict, reasons): the one the script left (no_gpu, build_failed), else pass only
    when no step failed and every expected test file ran and passed."""
    given = (_read(work / "verdict") or "").strip()
    if given:
        return given, [given]
    reasons = [f"step {n} failed (rc={s['rc']})" for n, s in sorted(st.items()) if _failed(n, s)]
    reasons += [r for r in (test_file_problem(n, st, tests) for n in expected_tests(work)) if r]
    if not expected_tests(work):
        reasons.append("no GPU test file was listed (pytest/expected.txt is missing or empty)")
    return ("fail" if reasons else "pass"), reasons


def _failed(name: str, s: dict) -> bool:
    return s["rc"] not in (0, "skipped") and name != "nvidia_smi"


def summarize(work: Path) -> dict:
    st = steps(work)
    gpu = None
    tail = (st.get("gpu_visible") or {}).get("tail") or ""
    for line in tail.splitlines():
        if line.startswith("{"):
            try:
                gpu = json.loads(line)
            except ValueError:
                pass
    tests = {p.stem: junit(p) for p in sorted((work / "pytest").glob("*.xml"))}
    for name, s in st.items():
        if name.startswith("pytest_") and name[7:] not in tests:
            tests[name[7:]] = {"error": f"rc={s['rc']}, no junit report", "tail": s["tail"]}
    san = {name[len("sanitizer_"):]: {"rc": s["rc"], **sanitizer(_read(work / f"{name}.log"))}
           for name, s in st.items() if name.startswith("sanitizer_")}
    verdict, reasons = verdict_of(work, st, tests)
    return {
        "verdict": verdict,
        "verdict_reasons": reasons,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("DSV41_COMMIT"),
        "gpu": gpu,
        "nvidia_smi": (st.get("nvidia_smi") or {}).get("tail"),
        "toolchain": _json(work / "toolchain.json") if (work / "toolchain.json").exists() else None,
        "failed_steps": sorted(n for n, s in st.items() if _failed(n, s)),
        "skipped_steps": sorted(n for n, s in st.items() if s["rc"] == "skipped"),
        "tests_expected": expected_tests(work),
        "smoke": _results(work, "smoke", st, "smoke_"),
        "model": _results(work, "model", st, "model_"),
        "benchmarks": {p.stem: _json(p) for p in sorted((work / "bench").glob("*.json"))},
        "tests": tests,
        "sanitizer": san,
        "clocks_during_benchmarks": clocks(work / "clocks.csv"),
        "steps": st,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 64
    summary = summarize(Path(argv[0]))
    Path(argv[1]).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"verdict {summary['verdict']}; " + ("; ".join(summary["verdict_reasons"]) or "every step passed"))
    return {"pass": 0, "no_gpu": 2}.get(summary["verdict"], 1)


if __name__ == "__main__":
    sys.exit(main())
