"""SSD writes off the request path (CacheConfig.store_write_behind_bytes > 0, the default):
a background thread commits what insert/match queued; flush() is when blocks are
acknowledged; the queue is bounded; a process that exits normally loses no queued write;
and under SIGKILL every acknowledged block survives and nothing torn or wrong is ever
served."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.manager import DEFAULT_WRITE_BEHIND_BYTES

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, kill_during, rand_tokens

BB = LAYOUT.block_bytes


def make(path, store_fault=None, **kw) -> PrefixCache:
    kw.setdefault("block_tokens", B)
    kw.setdefault("gpu_capacity_bytes", 128 * BB)
    kw.setdefault("device", "cpu")
    kw.setdefault("swa_capacity_bytes", 0)
    kw.setdefault("store_durability", "fsync")
    return PrefixCache(TINY, CacheConfig(store_dir=str(path), **kw), weights_id=WEIGHTS_ID, store_fault=store_fault)


def pays(cache: PrefixCache, tokens) -> torch.Tensor:
    return torch.from_numpy(chain_payloads(np.asarray(tokens, "<u4"), cache.key("a")))


def test_background_commits_then_flush_acknowledges(tmp_path):
    rng = np.random.default_rng(0)
    cache = make(tmp_path / "s")
    prompts = [rand_tokens(rng, 4 * B) for _ in range(8)]
    for p in prompts:
        want = pays(cache, p)
        given = want.clone()
        cache.release(cache.insert(p, given, "a"))
        given.fill_(0xEE)  # the caller reuses its buffer at once: the store has its own copy
    cache.flush()
    assert len(cache.store) == 32 and cache.store.pending_bytes == 0
    # Extending a prefix whose blocks were only queued links to them (no rewrite).
    longer = np.concatenate([prompts[0], rand_tokens(rng, B)])
    m = cache.match(longer, "a")
    cache.insert(longer, pays(cache, longer), "a", match=m)
    cache.release(m)
    cache.flush()
    assert len(cache.store) == 33
    cache.close()
    with make(tmp_path / "s") as again:  # a new process's view: everything verified from the SSD
        for p in prompts + [longer]:
            again.pool.evict_all()
            m = again.match(p, "a")
            assert m.ssd_blocks == p.size // B and torch.equal(again.read_blocks(m), pays(again, p))
            again.release(m)


def test_the_queue_is_bounded(tmp_path):
    rng = np.random.default_rng(1)
    cache = make(tmp_path / "s", store_write_behind_bytes=2 * BB)
    seen = []
    real = cache.store.put_chain

    def put_chain(**kw):
        seen.append(cache.store.pending_bytes)
        return real(**kw)

    cache.store.put_chain = put_chain
    for _ in range(10):
        p = rand_tokens(rng, 5 * B)
        cache.release(cache.insert(p, pays(cache, p), "a"))
    # Each request queues its 5 blocks (one put_chain) on top of a queue at or below the
    # cap: past the cap it commits itself instead of leaving more queued.
    assert len(seen) == 10 and max(seen) <= 2 * BB
    cache.close()
    with make(tmp_path / "s") as again:
        assert len(again.store) == 50


def test_the_default_writes_in_the_background(tmp_path):
    cache = make(tmp_path / "s")
    assert cache.cache_config.store_write_behind_bytes == DEFAULT_WRITE_BEHIND_BYTES > 0
    assert cache.ssd.committer is not None
    cache.close()


_EXIT_CHILD = """
import sys, time
import numpy as np, torch
sys.path.insert(0, {root!r})
from tests.cache.test_write_behind import make, pays
from tests.cache.helpers import B
def slow(stage):  # a slow disk: the background writer falls behind the requests
    if stage == "write":
        time.sleep(0.05)
cache = make({path!r}, store_fault=slow)
for s in range(24):
    toks = np.random.default_rng(s).integers(0, 256, 3 * B).astype("<u4")
    cache.release(cache.insert(toks, pays(cache, toks), "a"))
print("queued", cache.store.pending_bytes, flush=True)
"""  # ...and the script ends: no flush(), no close()


def test_a_normal_exit_commits_what_is_queued(tmp_path):
    path = str(tmp_path / "s")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(root) / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _EXIT_CHILD.format(root=root, path=path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 0, "nothing was still queued at exit: slow the writer more"
    _check_acked(path, list(range(24)))


def _child(path: str, seed: int, wfd: int) -> None:
    # A forked child inherits the parent's objects but not its threads: collecting one whose
    # C++ I/O engine owned threads would crash. Nothing here needs the cyclic collector.
    gc.disable()
    try:
        torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
        cache = make(path)
        rng = np.random.default_rng(seed)
        done = []
        while True:
            s = int(rng.integers(1 << 40))
            toks = np.random.default_rng(s).integers(0, 256, 3 * B).astype("<u4")
            cache.release(cache.insert(toks, pays(cache, toks), "a"))
            done.append(s)
            if rng.random() < 0.3:
                cache.flush()
                os.write(wfd, ("A " + " ".join(map(str, done)) + "\n").encode())
                done = []
    except BaseException as e:  # pragma: no cover - reported to the parent
        os.write(wfd, f"E {e!r}\n".encode())
    finally:
        os._exit(0)


def _check_acked(path: str, seeds: list[int]) -> None:
    with make(path) as cache:
        assert not [n for n in os.listdir(path) if n.startswith(".tmp-")]
        assert cache.store.verify()["corrupt"] == 0
        for s in seeds:
            toks = np.random.default_rng(s).integers(0, 256, 3 * B).astype("<u4")
            m = cache.match(toks, "a")
            assert m.ssd_blocks == 3, f"chain {s} lost"
            assert torch.equal(cache.read_blocks(m), pays(cache, toks))
            cache.release(m)


def test_sigkill_never_loses_an_acknowledged_block(tmp_path):
    rng = np.random.default_rng(7)
    path = str(tmp_path / "s")
    make(path).close()
    acked: list[int] = []
    for _ in range(6):
        seed = int(rng.integers(1 << 31))
        text = kill_during(lambda w: _child(path, seed, w), float(rng.uniform(0.2, 0.6)))
        assert "\nE " not in "\n" + text, text
        now = [int(x) for line in text.splitlines() if line.startswith("A ") for x in line[2:].split()]
        # Right after the kill: the chains acknowledged last, the ones most at risk.
        _check_acked(path, now[-40:])
        acked += now
    assert acked, "no child acknowledged anything before its kill: widen the window"
    _check_acked(path, acked)  # and every one, once, at the end
