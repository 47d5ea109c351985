"""One server process of tests/engine/test_remote_engines.py: an engine whose cache has no
local SSD, only the remote tier, runs one phase of two conversations and prints JSON.

    write:  turn 1 of conversation 1 (snapshot TTL 60 s) and of conversation 2 (TTL 1 s)
    resume: turn 2 of both, after conversation 2's snapshot expired
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch


def conversation(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TURN1 = {1: conversation(11, 40), 2: conversation(12, 40)}
NEW = {1: conversation(21, 6), 2: conversation(22, 6)}
BLOCK, NS = 16, "tenant-x"


def digest(cache, prompt) -> dict:
    """What a resume of `prompt` gets from the cache: its global KV blocks and snapshot."""
    m = cache.match(prompt, namespace=NS, max_tokens=len(prompt) - 1)
    try:
        out = {"blocks": m.num_blocks, "kv": hashlib.sha256(cache.read_blocks(m).numpy().tobytes()).hexdigest()}
        s = m.snapshot
        out["snapshot_tokens"] = s.num_tokens if s is not None else 0
        if s is not None:
            h = hashlib.sha256()
            for k in sorted(s.tensors):
                h.update(k.encode() + s.tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
            out["snapshot"] = h.hexdigest()
        return out
    finally:
        cache.release(m)


def make_cache(model, blocks, snapshots, ttl, clock=time.time, timeout_s=2.0):
    from dsv41.cache import CacheConfig, PrefixCache
    cc = CacheConfig(block_tokens=BLOCK, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 26,
                     swa_ttl_s=ttl, remote_blocks=blocks, remote_snapshots=snapshots, remote_snapshot_ttl_s=ttl,
                     remote_lookup_timeout_s=timeout_s)
    c = PrefixCache.for_model(model, cc, clock=clock)
    if blocks or snapshots:
        assert c.remote.wait_connected(30.0), "remote tier not reachable"
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["write", "resume"])
    ap.add_argument("--blocks", required=True)
    ap.add_argument("--snapshots", required=True)
    ap.add_argument("--history", help="resume: the JSON the write phase printed")
    a = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(1)   # a tiny model on a shared 2-core machine: threads only contend
    from dsv41.config import ModelConfig
    from dsv41.engine import Engine, SamplingParams
    from dsv41.model import Model
    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    out: dict = {"seconds": {"startup": time.perf_counter() - t0}}
    if a.phase == "write":
        for conv, ttl in ((1, 60.0), (2, 1.0)):
            cache = make_cache(model, a.blocks, a.snapshots, ttl)
            t1 = time.perf_counter()
            o = Engine(model, cache=cache).generate([TURN1[conv]], sp, namespace=NS)[0]
            out["seconds"][f"generate{conv}"] = time.perf_counter() - t1
            out[conv] = {"output": o.output_tokens, "path": o.stats.path}
            assert cache.remote.flush(30.0)
            cache.close()
        out["written_at"] = time.time()
    else:
        hist = json.loads(a.history)
        time.sleep(max(0.0, hist["written_at"] + 1.5 - time.time()))   # conversation 2's snapshot expires
        cache = make_cache(model, a.blocks, a.snapshots, 60.0)
        eng = Engine(model, cache=cache, replay="bounded")
        for conv in (1, 2):
            prompt = TURN1[conv] + hist[str(conv)]["output"] + NEW[conv]
            t1 = time.perf_counter()
            o = eng.generate([prompt], sp, namespace=NS)[0]
            out["seconds"][f"generate{conv}"] = time.perf_counter() - t1
            s = o.stats
            out[conv] = {"output": o.output_tokens, "path": s.path, "global_hit": s.global_hit_tokens,
                         "swa_hit": s.swa_hit_tokens, "replayed": s.replayed_tokens, "digest": digest(cache, prompt)}
        out["remote"] = {k: v for k, v in cache.metrics.to_dict().items() if k.startswith("dsv41_cache_remote_")}
        cache.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stderr.flush()
    os._exit(rc)   # every write was flushed and the caches closed; skip seconds of client teardown
