#!/usr/bin/env bash
# One call on a GPU machine (its own torch, nvcc and pytest): build dsv41._C, then check and
# time the CUDA kernels and the model, in order of value, under one deadline. The CPU-only
# suite is not run (CI runs it).
#
#   OUT=/some/dir DSV41_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh
#   (or: bash scripts/gpu_check.sh DIR)
#
# Writes exactly three files into $OUT (the device tool brings back at most 8):
#   gpu_check.json          verdict, device, toolchain, clocks, build, every smoke case,
#                           model run, benchmark JSON and test outcome inlined
#                           (scripts/gpu_check_report.py)
#   gpu_check_steps.log     what ran, when, with exit codes and the tails of the outputs
#   gpu_check_logs.tar.gz   every log in full (build, smoke, benchmarks, pytest, sanitizer)
# Steps: GPU visible? (if not: verdict "no_gpu", exit 2 at once) -> build -> build_check
# (the compiler and the libstdc++ in use, no private libstdc++ in _C.so, and an op called
# with a bad argument must raise in Python, not kill the process: dsv41/toolchain.py) ->
# one tiny synchronous smoke call per kernel, each in its own process -> the GPU test files,
# each in its own process, with a per-test timeout -> the model on the GPU against the CPU
# reference (scripts/gpu_model.py: v41-small, then a Flash-width few-layer model) ->
# benchmarks top-k, attention (mma, then wgmma), copy, each with its own cap, SM/memory
# clocks sampled meanwhile -> bench/bench_decode.py when the tree has it -> compute-
# sanitizer memcheck and racecheck on one small attention and one top-k case (if the tool
# is there). Verdict "pass" only when no step failed and every GPU test file ran (a test
# file skipped for the deadline, or with no passing test, fails it).
# Exit: 0 pass, 1 otherwise, 2 no GPU. Knobs: DSV41_GPU_CHECK_SECONDS (the deadline,
# default 540), DSV41_PYTHON, DSV41_COMMIT (default: bench/_meta.py's, "unknown" outside
# the project's own checkout), DSV41_TEST_TIMEOUT (per test, 120 s).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-${OUT:?set OUT or pass a folder}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
PY="${DSV41_PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dsv41-gpu-check.XXXXXX")"  # full logs; archived at the end
STEPS="$OUT/gpu_check_steps.log"
: >"$STEPS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" DSV41_CUDA=1
# The project's commit (never that of a repository the tree was copied into): bench/_meta.py.
commit="$(timeout 20 "$PY" "$ROOT/bench/_meta.py" 2>/dev/null)"
export DSV41_COMMIT="${DSV41_COMMIT:-${commit:-unknown}}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

deadline=$(( $(date +%s) + ${DSV41_GPU_CHECK_SECONDS:-540} ))
# Seconds a step may take: at most $1, never past the deadline (keeps 15 s for the report).
left() { local l=$(( deadline - 15 - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$STEPS"; }
# run NAME CAP CMD...: CMD with its output in $WORK/NAME.log and its exit code in
# $WORK/NAME.rc (124: hit its cap); skipped (rc "skipped") when the deadline is too near.
run() {
  local name=$1 cap; cap=$(left "$2"); shift 2
  if [ "$cap" -lt 5 ]; then echo skipped >"$WORK/$name.rc"; log "skip $name: deadline"; return 1; fi
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$WORK/$name.rc"
  log "$name rc=$rc in $(( SECONDS - t0 ))s (cap ${cap}s)"
  [ "$rc" = 0 ] || tail -n 8 "$WORK/$name.log" | sed 's/^/    /' >>"$STEPS"
  return "$rc"
}

clock_pid=""
# On any exit: the report (its exit code becomes the script's), the steps log, the archive.
finish() {
  trap - EXIT TERM INT
  [ -n "$clock_pid" ] && kill "$clock_pid" 2>/dev/null
  timeout 60 "$PY" "$ROOT/scripts/gpu_check_report.py" "$WORK" "$OUT/gpu_check.json" >>"$STEPS" 2>&1
  local rc=$?
  [ -f "$OUT/gpu_check.json" ] || { log "report failed (rc=$rc, see the archive)"; rc=1; }
  cp "$STEPS" "$WORK/steps.log" 2>/dev/null
  tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" . 2>>"$STEPS"
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT
trap 'log "stopped by a signal"; exit 1' TERM INT

log "dsv41 gpu_check, commit $DSV41_COMMIT, deadline $(date -u -d "@$deadline" +%H:%M:%S)"

# ---- 1. Is a GPU visible? Without one every GPU test would skip and look green. ----------
run nvidia_smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm \
  --format=csv
run gpu_visible 60 "$PY" -c "import torch, json; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; \
print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda, 'devices': n, \
'name': torch.cuda.get_device_name(0) if n else None}))"
if ! grep -q '"devices": [1-9]' "$WORK/gpu_visible.log" 2>/dev/null; then
  echo no_gpu >"$WORK/verdict"
  log "no CUDA GPU visible to torch: nothing to check (verdict no_gpu)"
  exit
fi

# ---- 2. Build ------------------------------------------------------------------------------
# A toolkit root has both bin/nvcc and include/cuda_runtime.h (an nvcc wrapper on PATH may not).
if [ -z "${CUDA_HOME:-}" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
  for c in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    if [ -f "$c/include/cuda_runtime.h" ]; then export CUDA_HOME="$c"; break; fi
  done
fi
if ! run build 240 "$PY" setup.py build_ext --inplace; then
  echo build_failed >"$WORK/verdict"
  exit
fi

# ---- 3. The build's soundness: toolchain, no private libstdc++, error paths raise -------
# (the first GPU run's build crashed on every TORCH_CHECK that formats a number)
run build_check 90 "$PY" -m dsv41.toolchain --json "$WORK/toolchain.json"

# ---- 4. One tiny synchronous call per kernel, each in its own process --------------------
mkdir -p "$WORK/smoke"
for c in $(timeout 60 "$PY" scripts/gpu_smoke.py --list); do
  run "smoke_$c" 60 "$PY" scripts/gpu_smoke.py "$c" --json "$WORK/smoke/$c.json"
done

# ---- 5. GPU test files, each in its own process; DSV41_TEST_TIMEOUT per test ------------
# (tests/conftest.py ends a test's process past it, printing every thread's stack). Every
# file listed here that exists must run and pass for a "pass" verdict (pytest/expected.txt).
export DSV41_TEST_TIMEOUT="${DSV41_TEST_TIMEOUT:-120}"
mkdir -p "$WORK/pytest"
: >"$WORK/pytest/expected.txt"
for f in tests/test_build.py tests/ops/test_cuda_attention.py tests/ops/test_cuda_selection.py \
         tests/ops/test_cache_ops.py tests/ops/test_dequant_tricks.py tests/formats/test_codecs.py \
         tests/formats/test_fp8_v4.py tests/cache/test_gpu.py tests/ops/test_kernel_wiring.py \
         tests/model/test_cache_writes.py tests/cache/test_pool_block_moves.py tests/cache/test_interop.py \
         tests/test_bench_copy.py; do
  [ -f "$f" ] || continue
  name="$(basename "$f" .py)"
  echo "$name" >>"$WORK/pytest/expected.txt"
  run "pytest_$name" 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --junitxml="$WORK/pytest/$name.xml" "$f"
done

# ---- 6. The model on the GPU against the CPU reference (scripts/gpu_model.py) ------------
mkdir -p "$WORK/model"
run model_v41_small 150 "$PY" scripts/gpu_model.py --preset v41-small --prompt 64 --steps 8 \
  --json "$WORK/model/v41_small.json"
# v41-flash widths on 4 layers and 8 routed experts (3.1B parameters): the CPU reference runs
# a short prompt; only the production path is timed at 4K tokens.
run model_flash_width 300 "$PY" scripts/gpu_model.py --flash-layers 4 --flash-experts 8 --prompt 32 --steps 4 \
  --timing-paths bf16 --json "$WORK/model/flash_width.json"

# ---- 7. Kernel benchmarks, each with its own cap, clocks sampled meanwhile ---------------
(nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
  --format=csv,noheader -lms 500 >"$WORK/clocks.csv" 2>&1) &
clock_pid=$!
mkdir -p "$WORK/bench"
run bench_topk 75 "$PY" bench/bench_topk.py --device cuda --quick --json "$WORK/bench/topk.json"
run bench_attention_mma 75 "$PY" bench/bench_attention.py --device cuda --quick --impl mma \
  --json "$WORK/bench/attention_mma.json"
run bench_attention_wgmma 75 "$PY" bench/bench_attention.py --device cuda --quick --impl wgmma \
  --json "$WORK/bench/attention_wgmma.json"
run bench_copy 60 "$PY" bench/bench_copy.py --device cuda --json "$WORK/bench/copy.json"
kill "$clock_pid" 2>/dev/null
wait "$clock_pid" 2>/dev/null
clock_pid=""

# ---- 8. The paged runtime's decode benchmark, once the tree has it ------------------------
if [ -f bench/bench_decode.py ]; then
  run bench_decode 150 "$PY" bench/bench_decode.py --device cuda --json "$WORK/bench/decode.json"
  # The 8-layer Flash-width model (16 routed experts, 7.2B parameters): issue 27's 5 ms target.
  run bench_decode_flash 150 "$PY" bench/bench_decode.py --device cuda --flash-layers 8 \
    --flash-experts 16 --batches 1 8 --steps 20 --baseline-max-batch 1 \
    --prefill-lengths 16384 --json "$WORK/bench/decode_flash.json"
else
  printf '{"benchmark": "decode", "skipped": "bench/bench_decode.py is not in this tree (the paged runtime has not landed)"}\n' \
    >"$WORK/bench/decode.json"
  log "skip bench_decode: bench/bench_decode.py is not in this tree"
fi

# ---- 9. compute-sanitizer on one small attention case and one top-k case ------------------
san="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
if [ -x "$san" ] && timeout 20 "$san" --version >"$WORK/sanitizer_version.log" 2>&1; then
  # The small wgmma case last: the newest kernel, checked if the deadline leaves time.
  for c in attention_small topk attention_wgmma_small; do
    for tool in memcheck racecheck; do
      run "sanitizer_${tool}_$c" 90 "$san" --tool "$tool" --error-exitcode 86 "$PY" scripts/gpu_smoke.py "$c"
    done
  done
else
  log "compute-sanitizer not found: skipped"
fi
