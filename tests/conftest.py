import faulthandler
import os
import sys

import pytest
import torch

import dsv41  # noqa: F401  (fails loudly if the extension is missing)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
