"""Deadlines of the remote tier against real servers on 127.0.0.1 (redis-server, a Mooncake
master with one storage process), started and stopped here by PID: a stopped (SIGSTOP)
Redis, a link that trickles 50 KB/s (tests/cache/trickle_proxy.py, a child process), the
breaker's probe once Redis answers again, and the exit of a process whose Mooncake calls
are stuck on a stopped master. redis-py, the official client, checks what the backend's
own reply parser reads."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import dsv41
from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.metrics import MetricsRegistry
from dsv41.cache.remote import Guarded, RemoteMetrics, RemoteUnavailable
from dsv41.cache.remote.redis import RedisBackend
from dsv41.config import ModelConfig

from ..remote_env import local_servers

B = 16
CONFIG = ModelConfig.preset("v41-tiny")
# What a call may take beyond its deadline here: scheduling on a shared 2-core machine
# (the failures these tests catch overran by 2 s and by 5 s).
SLACK_S = 0.05
PROXY = Path(__file__).with_name("trickle_proxy.py")
PACKAGE_ROOT = Path(dsv41.__file__).resolve().parents[1]   # the child imports the dsv41 under test


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with local_servers(tmp_path_factory.mktemp("deadlines"), mooncake=False) as s:
        yield s


def guarded(url: str, **kw) -> Guarded:
    g = Guarded(RedisBackend(url), RemoteMetrics(MetricsRegistry()), **kw)
    assert g.wait_connected(10.0)
    return g


@contextlib.contextmanager
def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def trickle_proxy(port: int, bytes_per_s: float):
    """tests/cache/trickle_proxy.py in front of 127.0.0.1:port, both directions throttled;
    yields the port it listens on and is killed by PID."""
    p = subprocess.Popen([sys.executable, str(PROXY), "--target", f"127.0.0.1:{port}", "--up", str(bytes_per_s),
                          "--down", str(bytes_per_s)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip().isdigit(), f"trickle proxy did not start: {line!r}"
        yield int(line)
    finally:
        p.kill()
        p.wait(10)
        p.stdout.close()


def bounded_call(g: Guarded, deadline_s: float, op: str, *args, **kw) -> float:
    """Calls op, which must fail as a counted fault within deadline_s + SLACK_S; its time."""
    t0 = time.perf_counter()
    with pytest.raises(RemoteUnavailable):
        g.call(op, deadline_s, *args, **kw)
    took = time.perf_counter() - t0
    assert took < deadline_s + SLACK_S, f"{op} took {took:.3f} s against a {deadline_s:.3f} s deadline"
    return took


def test_redis_calls_keep_their_deadline_while_the_server_is_stopped(servers):
    """A call that timed out drops its connection; the calls after it must not reconnect in
    the caller's thread, where redis-py's handshake waits its 2 s socket timeout (they took
    2.003 s each against a 50 ms deadline)."""
    g = guarded(servers.snapshots_url, breaker_failures=1000)   # the breaker must not hide a call
    try:
        g.call("put", 1.0, [("dl:stop", b"v" * 100)])
        rows = np.empty((1, 200), dtype=np.uint8)
        with stopped(servers.pids()["redis"]):
            for op, args in [("get", (["dl:stop"],)), ("get_into", (["dl:stop"], rows)), ("exists", (["dl:stop"],))] * 3:
                bounded_call(g, 0.05, op, *args)
        end = time.monotonic() + 10
        while True:   # answering again: a worker's new connection serves the next calls
            try:
                if g.call("get", 1.0, ["dl:stop"]) == [b"v" * 100]:
                    break
            except RemoteUnavailable:
                pass
            assert time.monotonic() < end, "redis never served again after SIGCONT"
            time.sleep(0.05)
    finally:
        g.close()


def test_redis_calls_over_a_trickling_link_keep_their_deadline(servers):
    """A 256 KB snapshot read with GETEX over a link passing 50 KB/s took 5.35 s against a
    0.134 s deadline (redis-py's reply reader has no deadline, only a per-read timeout that
    each trickle of bytes restarts). Reads into rows (MGET) and puts are bounded the same."""
    import redis
    raw = redis.Redis.from_url(servers.snapshots_url)
    g = None
    try:
        raw.set("dl:snap", os.urandom(256 << 10), px=300_000)
        raw.mset({f"dl:b{i}": os.urandom(8 << 10) for i in range(32)})
        with trickle_proxy(servers.ports["redis"], 50_000) as port:
            g = guarded(f"redis://127.0.0.1:{port}/0", breaker_failures=1000)
            rows = np.empty((32, 9000), dtype=np.uint8)
            calls = [("get", (["dl:snap"],), {"ttl_s": 300.0}),
                     ("get_into", ([f"dl:b{i}" for i in range(32)], rows), {}),
                     ("put", ([("dl:put", os.urandom(256 << 10))],), {"ttl_s": 300.0})]
            for op, args, kw in calls * 2:
                bounded_call(g, 0.134, op, *args, **kw)
            g.close()
            g = None
    finally:
        if g is not None:
            g.close()
        raw.close()


def test_hits_resume_soon_after_a_stopped_redis_answers_again(servers):
    """The open breaker probes Redis in the background (one PING in a worker) every
    remote_breaker_cooldown_s: hits resume within a second of SIGCONT, not when a 5 s
    cooldown ends, and no lookup waits for the probe."""
    import torch

    def cache() -> PrefixCache:
        cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 24,
                         remote_blocks=servers.snapshots_url, remote_lookup_timeout_s=0.05)
        c = PrefixCache(CONFIG, cc, weights_id="deadline-weights")
        assert c.remote.wait_connected(10.0)
        return c

    a, b = cache(), cache()
    try:
        tok = np.random.default_rng(5).integers(0, 30000, size=3 * B, dtype=np.uint32)
        a.release(a.insert(tok, torch.zeros(3, a.layout.block_bytes, dtype=torch.uint8), namespace="p"))
        assert a.remote.flush(10.0)

        def lookup() -> int:
            t0 = time.perf_counter()
            m = b.match(tok, namespace="p")
            took = time.perf_counter() - t0
            n = m.remote_blocks
            b.release(m)
            assert took < 0.05 + 3 * B * b.layout.block_bytes / 100e6 + SLACK_S, f"lookup took {took:.3f} s"
            return n

        with stopped(servers.pids()["redis"]):
            for _ in range(20):
                assert lookup() == 0
                if b.metrics.to_dict()["dsv41_cache_remote_breaker_state"]["backend=redis"] != 0:
                    break
            else:
                pytest.fail("the breaker never opened")
            t_end = time.monotonic() + 1.0
            while time.monotonic() < t_end:    # open, probing in the background meanwhile
                assert lookup() == 0
                time.sleep(0.02)
        t0 = time.monotonic()
        while lookup() != 3:
            assert time.monotonic() - t0 < 1.0, "no hit within 1 s of redis answering again"
            time.sleep(0.02)
    finally:
        a.close()
        b.close()


def test_backend_replies_agree_with_redis_py(servers):
    """The backend parses replies itself: what it reads (GETEX with its TTL, MGET, EXISTS,
    missing keys, empty and large values, SET NX) equals what redis-py reads from the same
    server, over RESP2 and RESP3."""
    import redis
    raw = redis.Redis.from_url(servers.snapshots_url)
    vals = {"dl:r0": b"", "dl:r1": b"x", "dl:r2": os.urandom(6001), "dl:r3": os.urandom(300_000),
            "dl:r4": b"\r\n$-1\r\n*2\r\n"}
    keys = list(vals) + ["dl:missing"]
    try:
        raw.mset(vals)
        for proto in (2, 3):
            g = guarded(servers.snapshots_url + f"?protocol={proto}")
            try:
                got = g.call("get", 2.0, keys, ttl_s=60.0)
                assert got == [raw.get(k) or None for k in keys]
                assert all(55_000 < raw.pttl(k) <= 60_000 for k in vals)    # GETEX PX set each TTL
                assert g.call("exists", 2.0, keys) == [bool(raw.exists(k)) for k in keys]
                rows = np.zeros((len(keys), 300_000), dtype=np.uint8)
                n = g.call("get_into", 2.0, keys, rows)
                assert n == [len(raw.get(k) or b"") for k in keys]
                assert all(rows[i, :k].tobytes() == (raw.get(keys[i]) or b"") for i, k in enumerate(n))
                g.call("put", 2.0, [("dl:nx", b"first")], ttl_s=60.0)
                g.call("put", 2.0, [("dl:nx", b"second")], ttl_s=60.0)   # NX: the first stays (a nil reply)
                assert raw.get("dl:nx") == b"first"
                g.call("remove", 2.0, ["dl:nx"])
                assert raw.exists("dl:nx") == 0
                g.backend.ping()
            finally:
                g.close()
    finally:
        raw.close()


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
