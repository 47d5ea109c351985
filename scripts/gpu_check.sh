#!/usr/bin/env bash
# One call on a GPU machine (with its own torch, nvcc and pytest): build dsv41._C there,
# run every test (GPU tests included) and every GPU benchmark, and write the results under
# $OUT (or the folder given as $1). Budget: under 8 minutes on one H200.
#
#   DSV41_COMMIT=$(git rev-parse --short HEAD) OUT=/some/dir bash scripts/gpu_check.sh
#
# Writes: build.log, pytest.log, pytest.xml, bench_*.json, gpu_check.json (the summary).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-${OUT:?set OUT or pass a folder}}"
mkdir -p "$OUT"
cd "$ROOT"
PY="${DSV41_PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" DSV41_CUDA=1
# A toolkit root has both bin/nvcc and include/cuda_runtime.h (an nvcc wrapper on PATH may not).
if [ -z "${CUDA_HOME:-}" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
  for c in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    if [ -f "$c/include/cuda_runtime.h" ]; then export CUDA_HOME="$c"; break; fi
  done
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
# One deadline for the whole script (default 460 s), so it ends inside 8 minutes whatever
# a step does: each step gets at most what is left.
deadline=$(( $(date +%s) + ${DSV41_GPU_CHECK_SECONDS:-460} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.csv"

step "build"
t0=$(date +%s)
timeout "$(left 200)" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - t0 ))
tail -3 "$OUT/build.log"
echo "build rc=$build_rc in ${build_s}s"

step "tests"
test_rc=1
if [ "$build_rc" = 0 ]; then
  timeout "$(left 200)" "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests 2>&1 | tee "$OUT/pytest.log" | tail -25
  test_rc=${PIPESTATUS[0]}
fi

step "benchmarks"
bench_rc=0
if [ "$build_rc" = 0 ]; then
  # Every GPU benchmark driver of the repo; each writes its own JSON.
  for b in bench/bench_*.py; do
    name="$(basename "$b" .py)"
    if "$PY" "$b" --help 2>/dev/null | grep -q -- "--device"; then
      timeout "$(left 120)" "$PY" "$b" --device cuda --json "$OUT/$name.json" >/dev/null 2>"$OUT/$name.log" || bench_rc=1
      tail -20 "$OUT/$name.log"
    fi
  done
fi

step "summary"
"$PY" - "$OUT" "$build_rc" "$build_s" "$test_rc" "$bench_rc" <<'PYEOF'
import glob, json, os, sys, datetime
import xml.etree.ElementTree as ET
out, build_rc, build_s, test_rc, bench_rc = sys.argv[1], *map(int, sys.argv[2:])
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": os.environ.get("DSV41_COMMIT"),
    "build": {"rc": build_rc, "seconds": build_s},
    "tests": {"rc": test_rc},
    "benchmarks": {"rc": bench_rc, "files": sorted(os.path.basename(p) for p in glob.glob(f"{out}/bench_*.json"))},
}
try:
    import torch
    summary["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    summary["torch"] = torch.__version__
except Exception as e:  # the summary must still be written
    summary["device_error"] = repr(e)
try:
    suite = ET.parse(f"{out}/pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    t = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    t["passed"] = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
    summary["tests"].update(t)
    summary["tests"]["failed_cases"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                        if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError) as e:
    summary["tests"]["error"] = repr(e)
with open(f"{out}/gpu_check.json", "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
PYEOF
[ "$build_rc" = 0 ] && [ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
