#!/usr/bin/env bash
# Starts (or stops) a local remote tier on loopback for `dsv41 demo` and the benchmarks:
# a Mooncake master, one Mooncake storage process and a redis-server on random free ports
# of 127.0.0.1. `start` prints the demo flags; `stop` stops the three by PID.
#
#   flags=$(bash scripts/remote-servers.sh start)   # e.g. --remote-blocks mooncake://127.0.0.1:41234 ...
#   dsv41 demo $flags
#   bash scripts/remote-servers.sh stop
#
# Options after the action: --state FILE (default /tmp/dsv41-remote-servers.json),
# --segment-mb N (Mooncake storage memory, default 256). Needs the mooncake wheel
# (requirements-dev.txt), libibverbs1 and redis-server (scripts/env.sh installs them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSV41_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
# servers.py uses the standard library only; it finds mooncake_* next to $PY.
exec "$PY" "$ROOT/python/dsv41/cache/remote/servers.py" "$@"
