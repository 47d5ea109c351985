# Sourced by scripts/test.sh and scripts/run.sh: makes .venv, installs what
# requirements-dev.txt names, builds dsv41._C in place (incrementally, with ninja) and
# installs the package in editable mode. Idempotent: a second run only re-checks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSV41_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
cd "$ROOT"

log() { printf '[dsv41 setup] %s\n' "$*" >&2; }

# System packages of the remote tier's tests (cache/remote): Mooncake's transfer engine
# needs libibverbs even over tcp; redis-server is the snapshot store. Installed when missing
# and we are root (CI); elsewhere a note says what to install.
need_apt=()
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need_apt[*]}"
    apt-get install -y -q --no-install-recommends "${need_apt[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need_apt[@]}" >/dev/null; }
  else
    log "missing ${need_apt[*]} (apt-get install them): the remote-tier tests will be skipped"
  fi
fi

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  "${DSV41_BASE_PYTHON:-python3}" -m venv "$VENV"
fi

req_stamp="$VENV/.requirements-$(sha256sum requirements-dev.txt | cut -c1-16)"
if [ ! -f "$req_stamp" ]; then
  log "installing requirements-dev.txt (torch is several GB: a few minutes the first time)"
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  touch "$req_stamp"
fi

# CUDA: torch would guess /usr/local; the toolkit here lives in /usr/local/cuda.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
# ccache through its masquerade directory: the compiler keeps the name g++, so torch's
# compiler-version check (which rejects CXX="ccache g++" with CUDA 13) still passes.
if [ -d /usr/lib/ccache ] && [ -z "${CXX:-}" ]; then export PATH="/usr/lib/ccache:$PATH"; fi

log "building dsv41._C (incremental)"
start=$(date +%s)
"$PY" setup.py -q build_ext --inplace >"$VENV/.build.log" 2>&1 || { cat "$VENV/.build.log" >&2; log "build failed"; exit 1; }
grep -m1 '^dsv41: building' "$VENV/.build.log" >&2 || true
log "build done in $(( $(date +%s) - start )) s"

if [ ! -x "$VENV/bin/dsv41" ]; then
  log "installing dsv41 in editable mode"
  DSV41_NO_EXT=1 "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
fi
export PATH="$VENV/bin:$PATH"
