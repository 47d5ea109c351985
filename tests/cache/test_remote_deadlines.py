"""Deadlines of the remote tier against real servers on 127.0.0.1 (a Mooncake master with
one storage process), started and stopped here by PID: the exit of a process whose
Mooncake calls are stuck on a stopped master."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import dsv41

from ..remote_env import local_servers

PACKAGE_ROOT = Path(dsv41.__file__).resolve().parents[1]   # the child imports the dsv41 under test


@contextlib.contextmanager
def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


_EXIT_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from dsv41.cache import CacheConfig, PrefixCache
    from dsv41.config import ModelConfig
    cc = CacheConfig(block_tokens=16, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 24,
                     remote_blocks=sys.argv[1], remote_lookup_timeout_s=0.05, remote_breaker_failures=100)
    c = PrefixCache(ModelConfig.preset("v41-tiny"), cc, weights_id="exit-weights")
    assert c.remote.wait_connected(30.0)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(8):   # every worker ends up stuck in a call to the stopped master
        c.release(c.match(np.arange(i, i + 48, dtype=np.uint32), namespace="x"))
    c.close()
    print("closed", flush=True)
""")


def test_exit_is_prompt_while_the_mooncake_master_is_stopped(tmp_path):
    """Calls stuck in a Mooncake client (its master stopped) keep their worker threads;
    those must not hold up the process's exit once the cache is closed (they did for
    30-32 s: the workers were not daemon threads and the interpreter joined them)."""
    with local_servers(tmp_path / "s", redis=False, segment_bytes=16 << 20) as s:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.Popen([sys.executable, "-c", _EXIT_CHILD, s.blocks_url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        master = s.pids()["mooncake_master"]
        try:
            assert p.stdout.readline().strip() == "ready"
            with stopped(master):
                p.stdin.write("go\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "closed"
                t0 = time.monotonic()
                try:
                    rc = p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pytest.fail("the process did not exit within 20 s of closing its cache")
                took = time.monotonic() - t0
            assert rc == 0 and took < 10, (rc, took)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            for f in (p.stdin, p.stdout):
                f.close()
