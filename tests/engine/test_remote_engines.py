"""Two engine processes, one remote tier (Mooncake for global KV, Redis for SWA snapshots):
process B resumes process A's conversation from the remote tier bit-identical to a local
both-hit, and after the snapshot's TTL takes bounded replay over the remote global KV,
identical to the same replay from a local cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dsv41.engine import Engine, SamplingParams

from ..remote_env import local_servers
from .conftest import Clock
from .remote_child import BLOCK, NEW, NS, TURN1, digest, make_cache

CHILD = Path(__file__).with_name("remote_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(phase: str, s, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)]
                                                       + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    p = subprocess.run([sys.executable, str(CHILD), phase, "--blocks", s.blocks_url, "--snapshots",
                        s.snapshots_url, *extra], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _local_reference(model, a: dict) -> dict:
    clock = Clock()
    local = make_cache(model, None, None, 60.0, clock=clock)
    eng = Engine(model, cache=local, replay="bounded")
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    ref = {}
    for conv in (1, 2):
        o1 = eng.generate([TURN1[conv]], sp, namespace=NS)[0]
        assert o1.output_tokens == a[str(conv)]["output"]   # process A computed the same turn 1
        if conv == 2:
            clock.t += 61.0          # past the TTL: the local snapshots expire
        prompt = TURN1[conv] + o1.output_tokens + NEW[conv]
        o2 = eng.generate([prompt], sp, namespace=NS)[0]
        ref[conv] = (o2, digest(local, prompt))
    local.close()
    return ref


def test_process_b_resumes_process_a_from_the_remote_tier(tiny_model, tmp_path):
    with local_servers(tmp_path) as s:
        a = _run("write", s)
        b = _run("resume", s, "--history", json.dumps(a))
    # The same conversations in one process with a local cache only (no remote tier).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the children: all three processes run the same kernels
    try:
        ref = _local_reference(tiny_model, a)
    finally:
        torch.set_num_threads(threads)
    # conversation 1: a both-hit from remote bytes, bit-identical to the local both-hit
    r1, (o, d) = b["1"], ref[1]
    assert r1["path"] == o.stats.path == "both_hit"
    assert r1["output"] == o.output_tokens
    assert r1["global_hit"] == o.stats.global_hit_tokens > 0 and r1["swa_hit"] == o.stats.swa_hit_tokens > 0
    assert r1["digest"] == d and d["snapshot_tokens"] > 0
    # conversation 2: the snapshot expired (Redis TTL); bounded replay over remote global KV
    r2, (o, d) = b["2"], ref[2]
    assert r2["path"] == o.stats.path == "encoder_replay"
    assert r2["output"] == o.output_tokens and r2["replayed"] == o.stats.replayed_tokens > 0
    assert r2["global_hit"] == o.stats.global_hit_tokens >= 2 * BLOCK
    rem = b["remote"]
    assert rem["dsv41_cache_remote_hits_total"]["role=blocks"] >= 4
    assert rem["dsv41_cache_remote_hits_total"]["role=snapshots"] == 1
    assert not rem.get("dsv41_cache_remote_verify_failures_total")


def test_engine_serves_correctly_through_remote_faults(tiny_model, tmp_path):
    """Requests through an engine whose remote tier breaks under it (a corrupt block, a
    Redis restart, a dead storage process, a dead master) get the tokens a cache-less
    engine computes, each lookup within its deadline, and every fault is counted."""
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with local_servers(tmp_path, segment_bytes=16 << 20) as s:
            writer = make_cache(tiny_model, s.blocks_url, s.snapshots_url, 60.0)
            reader = make_cache(tiny_model, s.blocks_url, s.snapshots_url, 60.0, timeout_s=0.1)
            prompts = {i: TURN1[1][:8] + [i] * 40 for i in range(5)}
            Engine(tiny_model, cache=writer).generate([prompts[i] for i in range(1, 5)], sp, namespace=NS)
            assert writer.remote.flush(30.0)
            # prompt 0's first block: a well-formed record with one flipped bit, written with
            # Mooncake's own client
            key = writer.key(NS)
            tok = np.asarray(prompts[0][:BLOCK], dtype=np.uint32).reshape(1, BLOCK)
            h = writer.hasher.hash_blocks(tok.reshape(-1), key)
            ((k, v),) = writer.remote.block_values(key, NS, h, tok, [0],
                                                   np.zeros((1, writer.layout.block_bytes), np.uint8), 0,
                                                   writer.hasher.root(key))
            v[-5] ^= 4
            assert writer.remote.blocks.backend.client.put_batch([k], [bytes(v)]) == 0
            eng = Engine(tiny_model, cache=reader, replay="bounded")
            plain = Engine(tiny_model)

            def serve(i: int, what: str):
                want = plain.generate([prompts[i]], sp)[0].output_tokens
                t0 = time.perf_counter()
                o = eng.generate([prompts[i]], sp, namespace=NS)[0]
                assert o.output_tokens == want, what
                return o, time.perf_counter() - t0

            o, _ = serve(0, "corrupt block")
            s.restart_redis()
            serve(1, "redis restarted")
            s.kill("mooncake_storage")
            serve(2, "storage process killed")
            s.kill("mooncake_master")
            for i in (3, 4):
                _, took = serve(i, "master killed")
                assert took < 3.0, took      # never the client's ~4.3 s hang
            m = reader.metrics.to_dict()
            assert m["dsv41_cache_remote_verify_failures_total"]["role=blocks,kind=corrupt"] >= 1
            assert sum(v for k, v in m["dsv41_cache_remote_errors_total"].items() if "mooncake" in k) >= 1
            writer.close()
            reader.close()
    finally:
        torch.set_num_threads(threads)
