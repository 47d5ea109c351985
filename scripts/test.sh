#!/usr/bin/env bash
# The test command: set up (venv, torch, build incl. CUDA kernels when nvcc is there),
# then ruff and the whole test suite. GPU tests skip cleanly without a GPU. Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Lint first (seconds): pyflakes-level errors, rules in pyproject.toml [tool.ruff].
ruff check --quiet python tests bench scripts examples
python -m pytest -q -p no:cacheprovider "$@"
