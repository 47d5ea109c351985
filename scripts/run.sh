#!/usr/bin/env bash
# The main job: set up, then `dsv41 demo` - an agent workload (shared system prompt and
# tool schema, a repository context, several multi-turn conversations, some resumed after
# their SWA snapshots expired) through the engine and the tiered prefix cache, on the
# embedded v41-tiny model with synthetic weights. Per-turn paths, hits, replayed tokens and
# TTFT, then a summary. The cache lives in ./dsv41-demo-cache (a second run starts with SSD
# hits). Extra args go to `dsv41 demo` (e.g. --json, --fresh, --preset v41-small).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dsv41 info
echo
dsv41 kv-bytes --preset v41-flash --compare v4-flash
echo
dsv41 demo "$@"
