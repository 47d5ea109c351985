#!/usr/bin/env bash
# The main job: set up, then print the KV byte budget of DeepSeek-V4.1-Flash against
# DeepSeek-V4-Flash, computed from the configs. Extra args go to `dsv41 kv-bytes`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dsv41 info
echo
dsv41 kv-bytes --preset v41-flash --compare v4-flash "$@"
