import faulthandler
import os
import sys

import pytest
import torch

import dsv41  # noqa: F401  (fails loudly if the extension is missing)

# GPU gating, one way for all of tests/: markers, resolved here (pyproject.toml lists them).
#   @pytest.mark.gpu         needs a CUDA GPU; skipped without one.
#   @pytest.mark.gpu(cpu_dry_run=True)   same, but DSV41_KERNEL_TEST_DEVICE=cpu runs it on the
#                            CPU, where the ops are the reference: a dry run of the kernel
#                            tests' harness (tests/ops/kernel_cases.py), not of a kernel.
#   @pytest.mark.no_gpu      must not see a GPU (dry runs of the GPU scripts); skipped with one.
# Nothing else in tests/ asks torch.cuda.is_available().
HAS_GPU = torch.cuda.is_available()
KERNEL_TEST_DEVICE = os.environ.get("DSV41_KERNEL_TEST_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    for item in items:
        gpu = item.get_closest_marker("gpu")
        if gpu is not None and not HAS_GPU and not (gpu.kwargs.get("cpu_dry_run") and KERNEL_TEST_DEVICE == "cpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("no_gpu") is not None and HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="a GPU is visible: this dry run would be a real run"))


@pytest.fixture
def gen():
    """A seeded CPU generator: every test draws its own reproducible random data."""
    return torch.Generator().manual_seed(1234)


# DSV41_TEST_TIMEOUT=seconds (scripts/gpu_check.sh sets it): a test that runs longer ends
# the whole pytest process with every thread's stack on stderr, so a hung kernel cannot eat
# the GPU run's deadline. gpu_check.sh runs each test file in its own process.
_TEST_TIMEOUT = float(os.environ.get("DSV41_TEST_TIMEOUT") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _TEST_TIMEOUT > 0:
        print(f"\n[DSV41_TEST_TIMEOUT={_TEST_TIMEOUT:g}s] {item.nodeid}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(_TEST_TIMEOUT, exit=True)
    try:
        yield
    finally:
        if _TEST_TIMEOUT > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory):
    """Loading a checkpoint whose mtimes moved (the shipped one, in a fresh checkout) writes a
    weights stamp into the user's cache (model/weights_id.py): the tests keep theirs in a
    temporary directory, never in the real home. Subprocesses inherit it."""
    old = os.environ.get("DSV41_CACHE_DIR")
    os.environ["DSV41_CACHE_DIR"] = str(tmp_path_factory.mktemp("dsv41-user-cache"))
    yield
    if old is None:
        os.environ.pop("DSV41_CACHE_DIR", None)
    else:
        os.environ["DSV41_CACHE_DIR"] = old
