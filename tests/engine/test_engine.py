"""Engine API: sampling, stop tokens, streaming, batching, statistics, the demo CLI."""
from __future__ import annotations

import json

import pytest
import torch

import dsv41
from dsv41.engine import Engine, SamplingParams
from dsv41.engine.sampler import make_generator, sample
from dsv41.engine.scheduler import Scheduler

from .conftest import tokens


def test_sampler_rules():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(), None) == 1
    sp = SamplingParams(temperature=1.0, top_p=0.01, seed=0)
    assert all(sample(logits, sp, make_generator(sp)) == 1 for _ in range(5))  # top-p keeps the best
    sp = SamplingParams(temperature=5.0, seed=42)
    a = [sample(logits, sp, g) for g in [make_generator(sp)] for _ in range(20)]
    b = [sample(logits, sp, g) for g in [make_generator(sp)] for _ in range(20)]
    assert a == b and len(set(a)) > 1          # seeded, and really sampling
    sp = SamplingParams(temperature=1.0, top_p=0.6, seed=1)
    g = make_generator(sp)
    assert {sample(logits, sp, g) for _ in range(50)} <= {1, 2}  # nucleus of 2 tokens
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generate_stream_stop_and_batching(tiny_model):
    m = tiny_model
    prompts = [tokens(20, 12), tokens(21, 30), tokens(22, 5)]
    sp = SamplingParams(max_new_tokens=4, temperature=0.9, seed=5)
    eng = Engine(m, max_batch=8)
    together = eng.generate(prompts, sp)
    alone = [Engine(m).generate([p], sp)[0] for p in prompts]
    assert [o.output_tokens for o in together] == [o.output_tokens for o in alone]
    o = together[1]
    s = o.stats
    assert o.finish_reason == "length" and len(o.output_tokens) == 4 and s.path == "cold"
    assert s.ttft_s > 0 and len(s.token_latencies_s) == 3 and s.decode_tokens_per_s > 0
    assert s.bytes["state_global"] > 0 and s.bytes["state_swa"] > 0
    # a stop token ends the request; streaming yields the same tokens
    ref = alone[0].output_tokens
    stop = SamplingParams(max_new_tokens=4, temperature=0.9, seed=5, stop_token_ids=(ref[1],))
    g = Engine(m).generate([prompts[0]], stop)[0]
    k = ref.index(ref[1])
    assert g.finish_reason == "stop" and g.output_tokens == ref[:k + 1]
    events = list(Engine(m).stream(prompts[2], sp))
    assert [e.token for e in events] == alone[2].output_tokens and events[-1].finished
    assert events[-1].output.output_tokens == alone[2].output_tokens
    # the top-level names
    assert dsv41.Engine is Engine and dsv41.SamplingParams is SamplingParams
    assert eng.metrics()["paths"]["cold"] == 3 and eng.metrics()["counters"]["finished"] == 3


def test_scheduler_budget_and_bad_requests(tiny_model):
    eng = Engine(tiny_model, max_batch=2, max_prefill_tokens=20)
    for n in (15, 15, 15):
        eng.add_request(tokens(n, n), SamplingParams(max_new_tokens=1))
    outs = eng.step()       # one prefill fits the token budget of the step
    assert len(outs) == 1 and len(eng.scheduler.waiting) == 2
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], request_id="x") and eng.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, 999])
    with pytest.raises(ValueError):
        Scheduler(max_batch=0)


def test_demo_cli_json(tmp_path, capsys):
    from dsv41.cli import main
    args = ["demo", "--json", "--quiet", "--cache-dir", str(tmp_path / "c"), "--conversations", "2",
            "--turns", "2", "--system-tokens", "16", "--tools-tokens", "16", "--repo-tokens", "32",
            "--user-tokens", "8", "--tool-tokens", "8", "--max-new-tokens", "2"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    paths = [t["path"] for t in res["turns"]]
    assert len(paths) == 4 and paths.count("encoder_replay") == 1 and "both_hit" in paths
    s = res["summary"]
    assert s["prefill_tokens_saved"] == s["prompt_tokens"] - s["prefill_tokens"] > 0
    assert s["replay_on_vs_off"][0]["replay_off"]["path"] == "recompute"
    assert s["bytes"]["global_kv_ssd"] > 0
    # a second run (fresh process state, same directory) finds the prefix on the SSD tier
    assert main(args) == 0
    res2 = json.loads(capsys.readouterr().out)
    assert res2["summary"]["warmup"]["ssd_hit_tokens"] > 0


def test_demo_runs_on_either_runtime_with_the_same_turns(tmp_path, capsys):
    from dsv41.cli import main
    base = ["demo", "--json", "--quiet", "--conversations", "2", "--turns", "2",
            "--system-tokens", "16", "--tools-tokens", "16", "--repo-tokens", "32",
            "--user-tokens", "8", "--tool-tokens", "8", "--max-new-tokens", "2"]
    turns = {}
    for rt in ("reference", "paged"):
        assert main(base + ["--runtime", rt, "--cache-dir", str(tmp_path / rt)]) == 0
        turns[rt] = [(t["path"], t.get("output_tokens"), t.get("prefill_tokens"))
                     for t in json.loads(capsys.readouterr().out)["turns"]]
    assert turns["reference"] == turns["paged"]


def test_memory_stats_count_the_pools_a_request_uses(tiny_model, make_cache):
    assert Engine(tiny_model, runtime="reference").memory_stats() == {}
    own = Engine(tiny_model, kv_memory_bytes=1 << 20).memory_stats()   # paged, its own pool
    assert own["global_kv"]["unit"] == "pages" and own["global_kv"]["used"] == 0
    assert own["sequence_slots"] == {"used": 0, "free": 8, "total": 8, "unit": "slots",
                                     "bytes": own["sequence_slots"]["bytes"]}
    cache, _ = make_cache()
    eng = Engine(tiny_model, cache=cache)
    before = eng.memory_stats()
    gpu = before["global_kv"]
    assert gpu["unit"] == "pages" and gpu["used"] == 0 and gpu["free"] == gpu["total"] > 0
    eng.generate([tokens(30, 40)], SamplingParams(max_new_tokens=3))
    after = eng.memory_stats()
    # 40 prompt + 2 fed-back output tokens: two full 16-token blocks stay cached, unreferenced;
    # the sequence's partial page went back to the pool with its slot
    assert after["global_kv"]["used"] == 2 and after["global_kv"]["referenced"] == 0
    assert after["global_kv"]["used"] + after["global_kv"]["free"] == gpu["total"]
    assert after["sequence_slots"]["used"] == 0
    swa = after["swa_snapshots"]
    assert swa["unit"] == "bytes" and 0 < swa["used"] and swa["used"] + swa["free"] == swa["total"]
    assert eng.counters["preemptions"] == 0
    assert eng.request_counts() == {"waiting": 0, "running": 0}
