#!/usr/bin/env bash
# The test command: set up (venv, torch, build incl. CUDA kernels when nvcc is there),
# then the whole test suite. GPU tests skip cleanly without a GPU. Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest -q -p no:cacheprovider "$@"
