"""A process that forgets close() exits promptly, with its own status, and what was
acknowledged is durable (issue 29, item 1).

Each case runs in a child process with a deadline: a hang is a failure, and so is a
signal. The sealer thread's race with interpreter shutdown (a seal still running when
the interpreter finalizes: SIGABRT, "terminate called without an active exception", in 3
of 40 runs) is made certain rather than likely: FAULT_SLOW_SEAL holds every seal in the
engine, with the GIL released, for 300 ms.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import B

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60  # a child imports torch (seconds on a loaded machine); a hang waits forever

PRELUDE = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from dsv41.cache import io
from tests.cache.helpers import B, key, open_store, rand_tokens, write_chain
"""


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = PRELUDE.format(root=str(ROOT)) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    try:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              timeout=DEADLINE_S, env=env, cwd=str(tmp_path))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child did not exit within {DEADLINE_S} s: {e.stderr!r}")


def _status(p: subprocess.CompletedProcess) -> str:
    if p.returncode < 0:
        return f"killed by {signal.Signals(-p.returncode).name}: {p.stderr[-2000:]}"
    return f"exit {p.returncode}: {p.stderr[-2000:]}"


def _records(path) -> int:
    from .helpers import open_store
    with open_store(path) as st:
        return len(st)


def test_a_writer_that_committed_nothing_exits_with_its_own_status(tmp_path):
    """Reproduced before the fix: the child hung forever (close() from __del__ during
    interpreter shutdown waited for a sealer thread that never ran again)."""
    p = _run(tmp_path, """
        st = open_store(sys.argv[1] + "/s")
        sys.exit(3)
    """)
    assert p.returncode == 3, _status(p)


def test_an_uncaught_exception_exits_with_status_1(tmp_path):
    p = _run(tmp_path, """
        st = open_store(sys.argv[1] + "/s")
        raise ValueError("bad argument")
    """)
    assert p.returncode == 1 and "ValueError: bad argument" in p.stderr, _status(p)


@pytest.mark.parametrize("trial", range(3))
def test_exit_during_a_seal_keeps_the_status_and_the_records(tmp_path, trial):
    """A commit is sealing (fdatasync, rename) when the main thread ends. Before the fix the
    interpreter finalized while the sealer was inside seal_files, and its return into
    Python killed the process with SIGABRT."""
    p = _run(tmp_path, """
        st = open_store(sys.argv[1] + "/s")
        rng = np.random.default_rng(0)
        write_chain(st, rand_tokens(rng, 4 * B), key())          # acknowledged
        st.engine.set_faults(io.FAULT_SLOW_SEAL)
        write_chain(st, rand_tokens(rng, 4 * B), key(), commit=False)
        st.commit_async()                                       # sealing as we exit
        sys.exit(5)
    """)
    assert p.returncode == 5, _status(p)
    assert _records(tmp_path / "s") == 8  # the acknowledged chain, and the one in flight


def test_a_prefix_cache_nobody_closed_exits_and_keeps_what_was_acknowledged(tmp_path):
    """The cache's background committer hands a commit to the store's sealer and the
    process ends while it seals."""
    p = _run(tmp_path, """
        import torch
        from dsv41.cache import CacheConfig, PrefixCache
        from tests.cache.helpers import LAYOUT, TINY, WEIGHTS_ID, chain_payloads
        cache = PrefixCache(TINY, CacheConfig(block_tokens=B, gpu_capacity_bytes=64 * LAYOUT.block_bytes,
                                              device="cpu", swa_capacity_bytes=0, store_durability="none",
                                              store_dir=sys.argv[1] + "/s"), weights_id=WEIGHTS_ID)
        rng = np.random.default_rng(1)
        for i in range(2):
            prompt = rand_tokens(rng, 4 * B)
            cache.release(cache.insert(prompt, torch.from_numpy(chain_payloads(prompt, cache.key("a"))), "a"))
            if i == 0:
                cache.flush()                                   # acknowledged
                cache.store.engine.set_faults(io.FAULT_SLOW_SEAL)
        import time
        time.sleep(0.1)                                         # the committer starts sealing
    """)
    assert p.returncode == 0, _status(p)
    assert _records(tmp_path / "s") >= 4


def test_demo_with_a_bad_argument_exits_instead_of_hanging(tmp_path):
    """Reproduced before the fix: `dsv41 demo --max-new-tokens -1` printed a traceback, then
    hung at exit with its store open."""
    p = _run(tmp_path, """
        from dsv41.cli import main
        sys.exit(main(["demo", "--conversations", "1", "--turns", "1", "--max-new-tokens", "-1",
                       "--cache-dir", sys.argv[1] + "/demo", "--quiet"]))
    """)
    assert p.returncode in (1, 2), _status(p)


def test_an_engine_closes_its_cache_on_the_way_out(tmp_path):
    """`with Engine(...)` closes the cache it was given on every way out, an error included:
    the store's queued writes are committed and its writer lock released."""
    from dsv41.cache import CacheConfig, PrefixCache
    from dsv41.config import ModelConfig
    from dsv41.engine import Engine, SamplingParams
    from dsv41.model import Model

    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=8 << 20, swa_capacity_bytes=0,
                     store_dir=str(tmp_path / "s"), store_durability="none")
    with pytest.raises(ValueError, match="bad"):
        with Engine(model, cache=PrefixCache.for_model(model, cc)) as eng:
            eng.generate([list(range(3 * B))], SamplingParams(max_new_tokens=1))
            raise ValueError("bad")
    assert eng.cache.store.closed
    with PrefixCache.for_model(model, cc) as cache:  # the lock is free again
        assert len(cache.store) == 3
