"""Summarize a scripts/gpu_check.sh work folder into one JSON file with everything inlined.

    python scripts/gpu_check_report.py WORK_DIR OUT_JSON

Reads what gpu_check.sh left in WORK_DIR (NAME.log / NAME.rc per step, smoke/*.json,
bench/*.json, pytest/*.xml, clocks.csv, verdict) and writes OUT_JSON: the verdict
("pass", "fail", "no_gpu", "build_failed"), the device, every step's exit code and
seconds-capped tail, every smoke case's result, every benchmark's report, every test
file's counts and failed cases, the sanitizer error summaries and the sampled clocks.
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


def summarize(work: Path) -> dict:
    st = steps(work)
    verdict = (_read(work / "verdict") or "").strip()
    gpu = None
    tail = (st.get("gpu_visible") or {}).get("tail") or ""
    for line in tail.splitlines():
        if line.startswith("{"):
            try:
                gpu = json.loads(line)
            except ValueError:
                pass
    smoke = {p.stem: _json(p) for p in sorted((work / "smoke").glob("*.json"))}
    for name, s in st.items():  # a case whose process died before writing its JSON
        if name.startswith("smoke_") and name[6:] not in smoke:
            smoke[name[6:]] = {"ok": False, "error": f"process ended with rc={s['rc']} and wrote no result",
                               "tail": s["tail"]}
    bench = {p.stem: _json(p) for p in sorted((work / "bench").glob("*.json"))}
    tests = {p.stem: junit(p) for p in sorted((work / "pytest").glob("*.xml"))}
    for name, s in st.items():
        if name.startswith("pytest_") and name[7:] not in tests:
            tests[name[7:]] = {"error": f"rc={s['rc']}, no junit report", "tail": s["tail"]}
    san = {name[len("sanitizer_"):]: {"rc": s["rc"], **sanitizer(_read(work / f"{name}.log"))}
           for name, s in st.items() if name.startswith("sanitizer_")}
    if not verdict:
        failed = [n for n, s in st.items() if s["rc"] not in (0, "skipped") and n != "nvidia_smi"]
        verdict = "fail" if failed else "pass"
    return {
        "verdict": verdict,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("DSV41_COMMIT"),
        "gpu": gpu,
        "nvidia_smi": (st.get("nvidia_smi") or {}).get("tail"),
        "failed_steps": sorted(n for n, s in st.items() if s["rc"] not in (0, "skipped") and n != "nvidia_smi"),
        "skipped_steps": sorted(n for n, s in st.items() if s["rc"] == "skipped"),
        "smoke": smoke,
        "benchmarks": bench,
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
    print(f"verdict {summary['verdict']}; failed steps: {', '.join(summary['failed_steps']) or 'none'}")
    return {"pass": 0, "no_gpu": 2}.get(summary["verdict"], 1)


if __name__ == "__main__":
    sys.exit(main())
