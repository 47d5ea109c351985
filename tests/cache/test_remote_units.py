"""The remote tier's parts that need no server: the record around every remote value, the
snapshot codec, the circuit breaker, keys, deadlines (with a backend that hangs)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dsv41.cache import CacheKey, MetricsRegistry, TensorSnapshot
from dsv41.cache.remote import (CircuitBreaker, Guarded, RemoteBackend, RemoteMetrics, RemoteUnavailable,
                                namespace_tag)
from dsv41.cache.remote.breaker import CLOSED, HALF_OPEN, OPEN
from dsv41.cache.remote.record import chain_ids, encode_record, encode_records, verify_record, verify_records
from dsv41.cache.remote.snapshot_codec import decode_snapshot, encode_snapshot

B = 16


def _key(ns="a", model="m" * 64):
    return CacheKey(ns, model, 1).encode()


def _block(seed=0, nblocks=3, nbytes=1000):
    g = np.random.default_rng(seed)
    tok = g.integers(0, 50000, size=(nblocks, B), dtype=np.uint32)
    pay = g.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    return tok, pay


def _enc(key, tok, pay, i, chain, hashes):
    return encode_record(key=key, tokens=tok[i], payload=pay[i], block_index=i, block_hash=hashes[i],
                         parent_hash=hashes[i - 1] if i else b"r" * 32, chain_id=chain[i],
                         parent_chain=chain[i - 1] if i else 0)


def _ver(v, key, tok, i, chain, hashes, nbytes=1000):
    return verify_record(v, key=key, block_index=i, block_hash=hashes[i],
                         parent_hash=hashes[i - 1] if i else b"r" * 32, parent_chain=chain[i - 1] if i else 0,
                         chain_id=chain[i], tokens=tok[i], payload_bytes=nbytes)


def test_record_roundtrip_and_every_failure_kind():
    key = _key()
    tok, pay = _block()
    hashes = [bytes([i]) * 32 for i in range(3)]
    chain = chain_ids(tok, key)
    assert len(set(chain)) == 3 and all(c for c in chain)
    v = _enc(key, tok, pay, 1, chain, hashes)
    ok = _ver(v, key, tok, 1, chain, hashes)
    assert ok.status == "ok" and bytes(ok.payload) == pay[1].tobytes()
    # every single flipped bit anywhere in the value is caught
    g = np.random.default_rng(1)
    for pos in list(g.integers(0, len(v), size=40)) + [0, 251, 255, 256, len(v) - 1]:
        bad = bytearray(v)
        bad[pos] ^= 1 << int(g.integers(0, 8))
        assert _ver(bytes(bad), key, tok, 1, chain, hashes).status == "corrupt", pos
    assert _ver(v[:-1], key, tok, 1, chain, hashes).status == "corrupt"
    assert _ver(v[:100], key, tok, 1, chain, hashes).status == "corrupt"
    # another namespace's or model's value under this key: foreign, never served
    assert _ver(v, _key("b"), tok, 1, chain, hashes).status == "foreign"
    assert _ver(v, _key("a", "n" * 64), tok, 1, chain, hashes).status == "foreign"
    # same key, other tokens / position / parent chain: a collision
    other = tok.copy()
    other[1, 3] += 1
    assert _ver(v, key, other, 1, chain, hashes).status == "collision"
    assert _ver(v, key, tok, 2, chain, hashes).status == "collision"
    before = tok.copy()
    before[0, 0] += 1
    chain2 = chain_ids(before, key)   # a different prefix before block 1, same block 1
    assert verify_record(v, key=key, block_index=1, block_hash=hashes[1], parent_hash=hashes[0],
                         parent_chain=chain2[0], tokens=tok[1]).status == "collision"
    assert _ver(v, key, tok, 1, chain, hashes, nbytes=999).status == "collision"
    # the batch encoder writes the same bytes
    parents = [b"r" * 32] + hashes[:2]
    one = [encode_record(key=key, tokens=tok[i], payload=pay[i], block_index=i, block_hash=hashes[i],
                         parent_hash=parents[i], chain_id=chain[i], parent_chain=chain[i - 1] if i else 0,
                         created_ns=7) for i in range(3)]
    many = encode_records(key=key, tokens=tok, payloads=pay, block_indices=[0, 1, 2], block_hashes=hashes,
                          parent_hashes=parents, chain_ids=chain, parent_chains=[0] + chain[:2], created_ns=7)
    assert [bytes(x) for x in many] == [bytes(x) for x in one]
    split = encode_records(key=key, tokens=tok, payloads=pay, block_indices=[0, 1, 2], block_hashes=hashes,
                           parent_hashes=parents, chain_ids=chain, parent_chains=[0] + chain[:2], created_ns=7,
                           parts=True)
    assert [b"".join(bytes(p) for p in x) for x in split] == [bytes(x) for x in one]


def test_batch_verifier_agrees_with_the_one_value_check():
    """verify_records serves exactly the run verify_record would, value by value, and names
    the same failure: every kind of damage, at the first, a middle and the last position,
    plus chain ids of the pre-seeded hasher equal to the one-step definition."""
    from dsv41.cache.remote.record import _chain_step
    n, key, root = 6, _key(), b"r" * 32
    tok, pay = _block(3, nblocks=n)
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    chain = chain_ids(tok, key)
    p = 0
    assert chain == [p := _chain_step(p, row, key) for row in tok]
    assert chain_ids(tok, key, 2, chain[1]) == chain[2:]
    empty = np.zeros((1, 0), dtype=np.uint32)   # a snapshot's tail at a block boundary
    assert chain_ids(empty, key, parent=chain[-1]) == [_chain_step(chain[-1], empty[0], key)]
    assert chain_ids(tok[:0], key) == []
    good = [bytes(_enc(key, tok, pay, i, chain, hashes)) for i in range(n)]
    other_ns = bytes(_enc(_key("b"), tok, pay, 2, chain_ids(tok, _key("b")), hashes))
    tok2 = tok.copy()
    tok2[2, 0] += 1

    def flip(v, pos):
        b = bytearray(v)
        b[pos] ^= 4
        return bytes(b)

    damage = {"missing": lambda i, v: None, "flip_payload": lambda i, v: flip(v, len(v) - 3),
              "flip_header": lambda i, v: flip(v, 20), "short": lambda i, v: v[:-1], "long": lambda i, v: v + b"\0",
              "foreign": lambda i, v: other_ns if i == 2 else v, "swap": lambda i, v: good[(i + 1) % n],
              "other_tokens": lambda i, v: bytes(_enc(key, tok2, pay, i, chain_ids(tok2, key), hashes))}
    for start in (0, 2):
        for name, f in damage.items():
            for at in (start, start + 1, n - 1):
                vals = list(good)
                vals[at] = f(at, vals[at])
                vals = vals[start:]
                rows, status = verify_records(vals, key=key, start=start, hashes=hashes[start:],
                                              parent_hash=hashes[start - 1] if start else root, chain=chain[start:],
                                              parent_chain=chain[start - 1] if start else 0, tokens=tok[start:],
                                              payload_bytes=1000)
                want, want_status = 0, None
                for j, v in enumerate(vals):
                    if v is None:
                        break
                    st = _ver(v, key, tok, start + j, chain, hashes).status if start + j else \
                        verify_record(v, key=key, block_index=0, block_hash=hashes[0], parent_hash=root,
                                      parent_chain=0, chain_id=chain[0], tokens=tok[0], payload_bytes=1000).status
                    if st != "ok":
                        want_status = st
                        break
                    want += 1
                assert (len(rows), status) == (want, want_status), (start, name, at)
                assert np.array_equal(rows, pay[start: start + want]), (start, name, at)
    rows, status = verify_records(good, key=key, start=0, hashes=hashes, parent_hash=root, chain=chain,
                                  parent_chain=0, tokens=tok, payload_bytes=1000)
    assert status is None and np.array_equal(rows, pay) and rows.flags.writeable


def test_snapshot_codec_roundtrip():
    snap = TensorSnapshot(37, {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
                            "c": torch.empty(0, 4), "d": torch.randint(0, 255, (9,), dtype=torch.uint8)},
                       {"format": 1, "kinds": ["x", "y"], "n": 4})
    back = decode_snapshot(encode_snapshot(snap))
    assert back.num_tokens == 37 and back.meta == snap.meta and list(back.tensors) == list(snap.tensors)
    for k, t in snap.tensors.items():
        u = back.tensors[k]
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u.view(torch.uint8) if u.numel() else u,
                                                                          t.view(torch.uint8) if t.numel() else t)
    back.tensors["b"][0] = 99   # writable, and a copy
    assert snap.tensors["b"][0] == 0
    with pytest.raises(ValueError):
        decode_snapshot(b"\x05\x00")


def test_breaker_opens_probes_and_closes():
    """Requests pass only while closed; an open breaker asks for one probe per cooldown
    (half-open while it runs); a failed probe opens it for another cooldown, a good one
    closes it."""
    now = [0.0]
    states = []
    b = CircuitBreaker(failures=2, cooldown_s=5.0, clock=lambda: now[0], on_change=states.append)
    assert b.allow() and not b.begin_probe()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow() and not b.begin_probe()
    now[0] = 5.1
    assert b.begin_probe() and b.state == HALF_OPEN and not b.allow()   # one probe
    assert not b.begin_probe()
    b.failure()
    assert b.state == OPEN and not b.allow() and not b.begin_probe()
    now[0] = 10.2
    assert b.begin_probe()
    b.success()
    assert b.state == CLOSED and b.allow() and states == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=float("nan"))


def test_namespace_tags():
    assert namespace_tag("") == "@" and namespace_tag("tenant-a") == "tenant-a"
    t = namespace_tag("tenant a:*")
    assert t.startswith("#") and ":" not in t and "*" not in t and t != namespace_tag("tenant b:*")


class _Gated(RemoteBackend):
    """A backend whose calls block until released when blocks(keys) says so (a dead
    Mooncake master hangs ~4.3 s), recording which thread ran each call."""
    scheme = "gated"

    def __init__(self, blocks=lambda keys: True):
        super().__init__("gated://")
        self.blocks = blocks
        self.release = threading.Event()
        self.ran_on: list[int] = []

    def exists(self, keys):
        self.ran_on.append(threading.get_ident())
        if self.blocks(keys):
            self.release.wait(10)
        return [False] * len(keys)

    get = put = remove = exists


def test_deadline_and_breaker_bound_a_hanging_backend():
    m = RemoteMetrics(MetricsRegistry())
    be = _Gated()
    g = Guarded(be, m, workers=2, breaker_failures=2, breaker_cooldown_s=60)
    assert g.wait_connected(5)
    t0 = time.perf_counter()
    causes = []
    for _ in range(5):
        with pytest.raises(RemoteUnavailable) as e:
            g.call("exists", 0.05, ["k"])
        causes.append(e.value.cause)
    took = time.perf_counter() - t0
    assert causes == ["timeout", "timeout", "breaker_open", "breaker_open", "breaker_open"]
    assert took < 1.0 and len(be.ran_on) == 2      # the open breaker makes no more calls
    assert m.errors.value(backend="gated", cause="timeout") == 2
    assert m.breaker_state.value(backend="gated") == OPEN
    be.release.set()
    g.close()


def test_calls_run_on_one_warm_worker_and_overflow_while_it_hangs():
    m = RemoteMetrics(MetricsRegistry())
    be = _Gated(blocks=lambda keys: "hang" in keys)
    g = Guarded(be, m, workers=3, breaker_failures=5, breaker_cooldown_s=60)
    assert g.wait_connected(5)
    # Three calls at once: every worker thread exists and has run a call.
    callers = [threading.Thread(target=g.call, args=("exists", 5.0, ["hang"])) for _ in range(3)]
    for t in callers:
        t.start()
    deadline = time.monotonic() + 5
    while len(be.ran_on) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(set(be.ran_on)) == 3
    be.release.set()
    for t in callers:
        t.join()
    while g._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    be.release.clear()
    # One call after another: always the same (primary) worker, never the caller.
    del be.ran_on[:]
    for _ in range(6):
        assert g.call("exists", 1.0, ["k"]) == [False]
    primary = be.ran_on[0]
    assert be.ran_on == [primary] * 6 and primary != threading.get_ident()
    with pytest.raises(RemoteUnavailable):
        g.call("exists", 0.05, ["hang"])  # the primary worker is now stuck in it
    assert g.call("exists", 1.0, ["k"]) == [False]
    assert be.ran_on[-1] != primary     # served by another worker meanwhile
    be.release.set()
    while g._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.call("exists", 1.0, ["k"]) == [False] and be.ran_on[-1] == primary
    g.close()


class _Flaky(RemoteBackend):
    """Calls fail while `down` is set; ping() also blocks until `unblock` (a probe that
    hangs) and counts how many probes ran at once."""
    scheme = "flaky"

    def __init__(self):
        super().__init__("flaky://")
        self.down = True
        self.unblock = threading.Event()
        self.pings = self.in_ping = self.most_in_ping = 0
        self.lock = threading.Lock()

    def exists(self, keys):
        if self.down:
            raise ConnectionError("down")
        return [True] * len(keys)

    get = put = remove = exists

    def ping(self):
        with self.lock:
            self.pings += 1
            self.in_ping += 1
            self.most_in_ping = max(self.most_in_ping, self.in_ping)
        try:
            self.unblock.wait(10)
            self.exists(["p"])
        finally:
            with self.lock:
                self.in_ping -= 1


def test_an_open_breaker_probes_in_a_worker_and_closes_when_the_backend_answers():
    """While the breaker is open, requests fail at once (none waits for a probe, even one
    that hangs) and one probe at a time goes out every cooldown; the first probe that
    succeeds closes the breaker and requests go through again."""
    m = RemoteMetrics(MetricsRegistry())
    be = _Flaky()
    g = Guarded(be, m, workers=3, breaker_failures=2, breaker_cooldown_s=0.05)
    assert g.wait_connected(5)
    for _ in range(2):
        with pytest.raises(RemoteUnavailable, match="error"):
            g.call("exists", 1.0, ["k"])
    assert g.breaker.state == OPEN
    t_end = time.monotonic() + 0.3
    while time.monotonic() < t_end:        # the first probe hangs in ping(): nobody waits for it
        t0 = time.perf_counter()
        with pytest.raises(RemoteUnavailable, match="breaker_open"):
            g.call("exists", 1.0, ["k"])
        assert time.perf_counter() - t0 < 0.02
        time.sleep(0.01)
    assert be.pings == 1 and g.breaker.state == HALF_OPEN
    be.unblock.set()                       # probes now fail at once (still down), one per cooldown
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:
        with pytest.raises(RemoteUnavailable):
            g.call("exists", 1.0, ["k"])
        time.sleep(0.01)
    assert 3 <= be.pings <= 12 and be.most_in_ping == 1
    assert m.errors.value(backend="flaky", cause="probe") == be.pings
    be.down = False                        # back: a probe closes the breaker within a cooldown or two
    t0 = time.monotonic()
    while True:
        try:
            assert g.call("exists", 1.0, ["k"]) == [True]
            break
        except RemoteUnavailable:
            assert time.monotonic() - t0 < 0.5
            time.sleep(0.01)
    assert g.breaker.state == CLOSED and m.breaker_state.value(backend="flaky") == CLOSED
    g.close()


def test_an_unconnected_backend_is_probed_with_connects():
    """A backend that never connected: connect attempts are the probes once the breaker
    opens, one at a time, and the first that succeeds serves the next call."""
    class NoServer(_Flaky):
        def __init__(self):
            super().__init__()
            self.connects = 0

        def connect(self):
            self.connects += 1
            if self.down:
                raise ConnectionError("refused")

    m = RemoteMetrics(MetricsRegistry())
    be = NoServer()
    g = Guarded(be, m, workers=2, breaker_failures=1, breaker_cooldown_s=0.05)
    end = time.monotonic() + 5
    while g.breaker.state != OPEN:
        assert time.monotonic() < end
        time.sleep(0.01)
    for _ in range(20):
        with pytest.raises(RemoteUnavailable, match="connecting"):
            g.call("exists", 1.0, ["k"])
        time.sleep(0.01)
    assert 2 <= be.connects <= 8 and m.errors.value(backend="flaky", cause="connect") == be.connects
    be.down = False
    while not g.connected:
        assert time.monotonic() < end
        with pytest.raises(RemoteUnavailable):
            g.call("exists", 1.0, ["k"])
        time.sleep(0.01)
    assert g.call("exists", 1.0, ["k"]) == [True] and g.breaker.state == CLOSED
    g.close()


_HUNG_EXIT_CHILD = """
import sys, threading
from dsv41.cache import MetricsRegistry
from dsv41.cache.remote import Guarded, RemoteBackend, RemoteMetrics, RemoteUnavailable

class Hung(RemoteBackend):
    scheme = "hung"
    def exists(self, keys):
        threading.Event().wait()   # never returns
    get = put = remove = exists

g = Guarded(Hung("hung://"), RemoteMetrics(MetricsRegistry()), workers=2)
assert g.wait_connected(5)
for _ in range(3):
    try:
        g.call("exists", 0.05, ["k"])
    except RemoteUnavailable:
        pass
g.close(timeout_s=0.1)
print("closed", flush=True)
"""


def test_a_process_exits_at_once_with_calls_stuck_in_workers():
    """Calls that never return keep their worker threads; the process still exits as soon
    as its main thread ends (the workers are daemon threads: the interpreter joined
    concurrent.futures' workers at exit, and a process waited for every stuck call)."""
    import subprocess
    import sys
    from pathlib import Path

    import dsv41
    import os
    env = dict(os.environ, PYTHONPATH=str(Path(dsv41.__file__).resolve().parents[1]))
    p = subprocess.Popen([sys.executable, "-c", _HUNG_EXIT_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        out, err = p.communicate(timeout=30)   # the imports: a few seconds on a busy machine
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("the process did not exit with calls stuck in its workers")
    assert p.returncode == 0 and out.strip() == "closed", err


def test_redis_reply_reader_parses_resp2_and_resp3_in_any_pieces_within_the_deadline():
    """_Reader.reply (every Redis call's replies): simple, error, integer, bulk, null and
    array replies of RESP2 and RESP3, arriving in any pieces; a malformed one raises
    ConnectionError; a peer that sends one byte at a time stops the read at its deadline
    (the whole read, not each receive)."""
    import socket

    import redis

    from dsv41.cache.remote.redis import _Reader

    big = np.random.default_rng(2).bytes(200_000)
    replies = [(b"+OK\r\n", b"OK"), (b":42\r\n", 42), (b":-7\r\n", -7), (b"$-1\r\n", None), (b"_\r\n", None),
               (b"$0\r\n\r\n", b""), (b"$5\r\na\r\nbc\r\n", b"a\r\nbc"),
               (b"$%d\r\n%s\r\n" % (len(big), big), big), (b"*-1\r\n", None),
               (b"*3\r\n$1\r\nx\r\n$-1\r\n:1\r\n", [b"x", None, 1]), (b"*2\r\n*1\r\n+a\r\n_\r\n", [[b"a"], None])]
    stream = b"".join(r for r, _ in replies)
    for pieces, seed in ((1, 0), (9, 1), (500, 2)):
        a, b, t = _serve(stream, pieces, seed)
        try:
            rd = _Reader(a, time.monotonic() + 10)
            assert [rd.reply() for _ in replies] == [v for _, v in replies]
            assert rd.pending == 0
        finally:
            t.join(10)
            a.close()
            b.close()
    for bad, exc in ((b"-ERR nope\r\n", redis.ResponseError), (b"?1\r\n", redis.ConnectionError),
                     (b"$%d\r\n" % (1 << 40), redis.ConnectionError),    # no allocation of a terabyte
                     (b":x\r\n", redis.ConnectionError), (b"$3\r\nabcXY", redis.ConnectionError)):
        a, b, t = _serve(bad, 1)
        t.join(10)
        try:
            with pytest.raises(exc):
                _Reader(a, time.monotonic() + 1).reply()
        finally:
            a.close()
            b.close()
    a, b = socket.socketpair()
    stop = threading.Event()

    def drip():   # a value of 100 bytes, one byte every 5 ms: 0.5 s in all
        b.sendall(b"$100\r\n")
        for _ in range(100):
            if stop.wait(0.005):
                return
            b.sendall(b"x")

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(redis.TimeoutError):
            _Reader(a, t0 + 0.1).reply()
        assert time.monotonic() - t0 < 0.1 + 0.05
    finally:
        stop.set()
        t.join(10)
        a.close()
        b.close()


def test_cxx_sha256_and_chain_ids_equal_the_python_definitions():
    """The C++ SHA-256 (SHA extensions and portable code) equals hashlib at every padding
    edge, and the C++ chain ids equal _chain_step bit for bit: random token ids over the
    whole uint32 range, keys of many lengths (empty too), empty token rows, any parent."""
    import hashlib
    import os

    from dsv41._ext import _C
    from dsv41.cache.remote.record import _chain_step
    for n in list(range(0, 140)) + [4096, 100_003]:
        d = os.urandom(n)
        assert _C.remote.sha256(d) == _C.remote.sha256(d, portable=True) == hashlib.sha256(d).digest(), n
    g = np.random.default_rng(5)
    for T, K in ((64, 70), (16, 0), (1, 1), (0, 33), (7, 200)):
        tok = g.integers(0, 1 << 32, size=(5, T), dtype=np.uint64).astype(np.uint32)
        key = g.bytes(K)
        for parent in (0, 1, (1 << 64) - 1, int(g.integers(0, 1 << 63))):
            p = parent
            assert chain_ids(tok, key, parent=parent) == [p := _chain_step(p, row, key) for row in tok], (T, K)
        assert chain_ids(tok, key, 3, 9) == [_chain_step(9, tok[3], key), _chain_step(_chain_step(9, tok[3], key),
                                                                                   tok[4], key)]


@pytest.mark.parametrize("nbytes", [1, 999, 5088, 3 * 4096 * 2 + 13])
def test_cxx_encode_and_verify_match_the_reference_at_any_size(nbytes):
    """encode_records (C++, the payload copied and CRC'd in one pass) writes encode_record's
    bytes and verify_records serves them, for payload sizes around the CRC's stream paths;
    a flipped payload bit is still caught there."""
    n, key, root = 4, _key(), b"r" * 32
    tok, pay = _block(7, nblocks=n, nbytes=nbytes)
    hashes = [bytes([i + 1]) * 20 for i in range(n)]   # hashes shorter than 32 bytes
    chain = chain_ids(tok, key)
    parents = [root] + hashes[:-1]
    one = [bytes(encode_record(key=key, tokens=tok[i], payload=pay[i], block_index=i, block_hash=hashes[i],
                               parent_hash=parents[i], chain_id=chain[i], parent_chain=chain[i - 1] if i else 0,
                               created_ns=5)) for i in range(n)]
    for parts in (False, True):
        many = encode_records(key=key, tokens=tok, payloads=pay, block_indices=range(n), block_hashes=hashes,
                              parent_hashes=parents, chain_ids=chain, parent_chains=[0] + chain[:-1], created_ns=5,
                              parts=parts)
        assert [b"".join(bytes(p) for p in v) if parts else bytes(v) for v in many] == one
    args = dict(key=key, start=0, hashes=hashes, parent_hash=root, chain=chain, parent_chain=0, tokens=tok,
                payload_bytes=nbytes)
    rows, status = verify_records(one, **args)
    assert status is None and np.array_equal(rows, pay)
    records = np.frombuffer(b"".join(one), dtype=np.uint8).reshape(n, -1)
    rows, status = verify_records(list(records), records=records, **args)
    assert status is None and np.array_equal(rows, pay)
    bad = list(one)
    bad[2] = bad[2][:-1] + bytes([bad[2][-1] ^ 0x80])
    rows, status = verify_records(bad, **args)
    assert status == "corrupt" and np.array_equal(rows, pay[:2])


def test_redis_send_gathers_chunks_and_resumes_partial_sends():
    """_send (the Redis backend's pipeline send): every byte of every chunk in order, with
    sendmsg sending only part of what it is given, more chunks than one sendmsg takes,
    memoryviews of other formats and empty chunks; a socket timeout is redis.TimeoutError,
    another socket error redis.ConnectionError; a TLS socket gets sendall per chunk."""
    import socket
    import ssl

    import redis

    from dsv41.cache.remote.redis import _IOV_MAX, _send

    class Trickle:
        """sendmsg takes at most `most` bytes per call and records what it got."""

        def __init__(self, most, fail=None):
            self.most, self.got, self.calls, self.fail = most, bytearray(), [], fail

        def settimeout(self, t):
            assert 0 < t <= 10

        def sendmsg(self, bufs):
            if self.fail:
                raise self.fail
            assert len(bufs) <= _IOV_MAX
            self.calls.append(len(bufs))
            take = self.most
            for b in bufs:
                part = bytes(b[:take])
                self.got += part
                take -= len(part)
                if not take:
                    break
            return self.most - take

    g = np.random.default_rng(0)
    chunks = [bytearray(b"*3\r\n"), memoryview(g.integers(0, 256, 70000, dtype=np.uint8)), b"",
              memoryview(np.arange(10, dtype=np.uint32)), b"tail"] + [bytes([i % 256]) * 7 for i in range(2500)]
    want = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    for most in (1, 1000, 65536, 1 << 30):
        s = Trickle(most)
        _send(s, chunks, time.monotonic() + 10)
        assert bytes(s.got) == want, most
    s = Trickle(1 << 30)
    _send(s, chunks, time.monotonic() + 10)
    assert s.calls == [_IOV_MAX, _IOV_MAX, len(chunks) - 1 - 2 * _IOV_MAX]   # the empty chunk is not sent
    with pytest.raises(redis.TimeoutError):
        _send(Trickle(10, fail=socket.timeout("timed out")), chunks, time.monotonic() + 10)
    with pytest.raises(redis.ConnectionError):
        _send(Trickle(10, fail=ConnectionResetError(104, "reset")), chunks, time.monotonic() + 10)

    class Tls(ssl.SSLSocket):   # no sendmsg on TLS: one sendall per chunk
        def __init__(self):
            self.got = bytearray()

        def settimeout(self, t):
            assert 0 < t <= 10

        def sendall(self, data):
            self.got += bytes(memoryview(data).cast("B"))

    t = Tls()
    _send(t, chunks, time.monotonic() + 10)
    assert bytes(t.got) == want
    a, b = socket.socketpair()   # and through a real socket, read on the other side meanwhile
    try:
        got = bytearray()
        reader = threading.Thread(target=lambda: [got.extend(x) for x in iter(lambda: b.recv(1 << 16), b"")])
        reader.start()
        _send(a, chunks, time.monotonic() + 10)
        a.shutdown(socket.SHUT_WR)
        reader.join(10)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()


def _serve(reply: bytes, pieces: int, seed: int = 0, stall: bool = False):
    """A socket whose peer (a thread) writes `reply` in `pieces` random pieces, then stays
    open (stall: stops after the first piece without closing)."""
    import socket

    a, b = socket.socketpair()
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, len(reply)), size=min(pieces, len(reply)) - 1,
                                                     replace=False).tolist()) if pieces > 1 else []
    parts = [reply[i:j] for i, j in zip([0] + cuts, cuts + [len(reply)])]

    def feed():
        for p in parts[:1] if stall else parts:
            b.sendall(p)
            time.sleep(0)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return a, b, t


def test_redis_mget_reply_is_read_into_rows_in_any_pieces():
    """_read_mget_into (Redis get_into): values land in their rows whatever pieces the reply
    arrives in (one byte at a time included, values across the 64 KiB buffer's edge);
    a missing key (RESP2 $-1, RESP3 _) and an empty value read as 0, a value longer than a
    row as -1 with the values after it still read; an error reply, a malformed one, a
    closed connection and a stalled server past the deadline raise."""
    import redis

    from dsv41.cache.remote.redis import _read_mget_into

    g = np.random.default_rng(1)
    width = 70000
    vals = [g.bytes(n) for n in (5, 65530, 65536 - 9, width, 3 * 4096)] + [None, b"", g.bytes(width + 1), None,
                                                                           g.bytes(100)]
    body = b"".join(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v) for v in vals)
    reply = b"*%d\r\n" % len(vals) + body
    want = [0 if v is None else -1 if len(v) > width else len(v) for v in vals]
    for pieces, seed in ((1, 0), (7, 1), (300, 2), (3000, 3)):
        a, b, t = _serve(reply, pieces, seed)
        try:
            rows = np.full((len(vals), width), 0xEE, dtype=np.uint8)
            assert _read_mget_into(a, rows, len(vals), time.monotonic() + 10) == want, pieces
            for i, (v, k) in enumerate(zip(vals, want)):
                if k > 0:
                    assert rows[i, :k].tobytes() == v
        finally:
            t.join(10)
            a.close()
            b.close()
    small = b"*4\r\n_\r\n$3\r\nabc\r\n$0\r\n\r\n$9\r\n123456789\r\n"   # RESP3's null, an empty value
    a, b, t = _serve(small, len(small))   # one byte at a time
    rows = np.zeros((4, 8), dtype=np.uint8)
    assert _read_mget_into(a, rows, 4, time.monotonic() + 10) == [0, 3, 0, -1] and rows[1, :3].tobytes() == b"abc"
    t.join(10)
    a.close()
    b.close()
    bad = {b"-ERR wrong number of arguments\r\n": redis.ResponseError,
           b"*3\r\n$1\r\na\r\n$1\r\nb\r\n": redis.ConnectionError,             # another count (and then closed)
           b"*1\r\n:5\r\n": redis.ConnectionError,                           # another type
           b"*1\r\n$3\r\nabcXY": redis.ConnectionError,                      # no CRLF after the value
           b"*1\r\n$3\r\nabc\r\n+extra\r\n": redis.ConnectionError,          # bytes after the reply
           b"*2\r\n$3\r\nabc\r\n$100\r\nshort": redis.ConnectionError}       # closed inside a value
    for reply, exc in bad.items():
        n = 2 if reply.startswith(b"*2") else 1
        a, b, t = _serve(reply, 3)
        t.join(10)
        if b"short" in reply or b"*3" in reply:
            b.close()
        try:
            with pytest.raises(exc):
                _read_mget_into(a, np.zeros((n, 200), dtype=np.uint8), n, time.monotonic() + 10)
        finally:
            a.close()
            b.close()
    a, b, t = _serve(reply, 2, stall=True)   # a server that stops answering: the deadline
    t0 = time.monotonic()
    try:
        with pytest.raises(redis.TimeoutError):
            _read_mget_into(a, np.zeros((2, 200), dtype=np.uint8), 2, t0 + 0.2)
        assert time.monotonic() - t0 < 0.2 + 0.1
    finally:
        a.close()
        b.close()
