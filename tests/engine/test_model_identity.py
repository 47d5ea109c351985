"""The cache never serves one model's KV to another (issue 10 section 1).

Two models that differ only in their weights (synthetic seeds, a fine-tuned checkpoint),
only in indexer_rotation, or in their config never share a block, in memory or through a
persistent store reused by another process; the same checkpoint loaded twice does share.
Before the fix, a second process with another seed took the first model's KV from the store
(192 SSD-hit tokens of a 256-token prompt with 64-token blocks): the key knew the config only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.manager import StoreDisabledWarning
from dsv41.config import ModelConfig
from dsv41.engine import Engine, SamplingParams
from dsv41.model import Model

from .conftest import tokens

TINY = ModelConfig.preset("v41-tiny")
BLOCK = 16
PROMPT = tokens(7, 4 * BLOCK)   # 3 full blocks are cached (the last token always runs)
SP = SamplingParams(max_new_tokens=2)

# One process's use of the cache, as the README shows it. argv: a JSON list of runs, each
# {"model": spec, "store": dir, "on_mismatch": ..., "save": dir or None}; prints one JSON
# line per run: hits, path, output tokens, or the error the construction raised.
WORKER = r"""
import json, sys, torch
from dsv41.cache import CacheConfig, PrefixCache
from dsv41.config import ModelConfig
from dsv41.engine import Engine, SamplingParams
from dsv41.model import Model

def build(spec):
    if spec["kind"] == "checkpoint":
        return Model.from_pretrained(spec["dir"])
    cfg = ModelConfig.preset("v41-tiny")
    if spec.get("eps"):
        cfg = cfg.replace(rms_norm_eps=spec["eps"])
    return Model.synthetic(cfg, seed=spec["seed"], indexer_rotation=spec.get("rotation", True))

prompt, block = json.loads(sys.argv[2]), int(sys.argv[3])
for run in json.loads(sys.argv[1]):
    model = build(run["model"])
    if run.get("save"):
        model.save_pretrained(run["save"])
    if run.get("finetune"):   # the same config, one weight changed, saved as another checkpoint
        with torch.no_grad():
            model.head.weight[0, 0] += 0.5
        model.save_pretrained(run["finetune"])
        continue
    cc = CacheConfig(block_tokens=block, device="cpu", swa_capacity_bytes=1 << 24, store_dir=run["store"],
                     store_durability="none", store_on_mismatch=run.get("on_mismatch", "error"))
    try:   # (the fallback is the README's construction before for_model: how the bug shows on old code)
        cache = (PrefixCache.for_model(model, cc) if hasattr(PrefixCache, "for_model")
                 else PrefixCache(model.config, cc))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__}), flush=True)
        continue
    sp = SamplingParams(max_new_tokens=2)
    out = Engine(model, cache=cache, replay="exact").generate([prompt], sp)[0]
    # A hit must give what a full prefill gives: run one when the cache hit.
    cold = Engine(model).generate([prompt], sp)[0].output_tokens if out.stats.ssd_hit_tokens else out.output_tokens
    print(json.dumps({"ssd": out.stats.ssd_hit_tokens, "gpu": out.stats.gpu_hit_tokens,
                      "path": out.stats.path, "out": out.output_tokens, "cold": cold,
                      "weights_id": getattr(model, "weights_id", None)}), flush=True)
    cache.close()
"""


def _run(runs: list[dict]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(runs), json.dumps(PROMPT), str(BLOCK)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_models_differing_in_weights_options_or_config_never_share_a_store_across_processes(tmp_path):
    s, ck = str(tmp_path / "store"), str(tmp_path / "store-ckpt")
    base, ft = str(tmp_path / "base"), str(tmp_path / "finetune")
    seed0 = {"kind": "synthetic", "seed": 0}
    first = _run([{"model": seed0, "store": s, "save": base},                 # fills `s`, saves base
                  {"model": {"kind": "checkpoint", "dir": base}, "store": ck},  # fills `ck`
                  {"model": {"kind": "checkpoint", "dir": base}, "finetune": ft}])
    assert [r["ssd"] for r in first] == [0, 0] and first[0]["path"] == first[1]["path"] == "cold"
    others = [{"kind": "synthetic", "seed": 1},                                 # only the weights
              {"kind": "synthetic", "seed": 0, "rotation": False},              # only indexer_rotation
              {"kind": "synthetic", "seed": 0, "eps": 1e-5}]                    # only the config
    runs = [{"model": m, "store": s, "on_mismatch": mode} for m in others for mode in ("error", "empty")]
    runs += [{"model": {"kind": "checkpoint", "dir": ft}, "store": ck, "on_mismatch": "empty"},
             {"model": seed0, "store": s},                                      # the same weights again
             {"model": {"kind": "checkpoint", "dir": base}, "store": ck}]       # the same checkpoint again
    second = _run(runs)
    for r in second[:6:2]:
        assert r == {"error": "StoreMismatchError"}                 # the store names another model
    for r in second[1:6:2] + [second[6]]:
        assert r["ssd"] == 0 and r["gpu"] == 0 and r["path"] == "cold", r
    same, ckpt = second[7], second[8]
    assert same["ssd"] == 3 * BLOCK and same["out"] == first[0]["out"] == same["cold"]
    assert ckpt["ssd"] == 3 * BLOCK and ckpt["out"] == first[1]["out"] == ckpt["cold"]
    assert ckpt["weights_id"].startswith("sha256:") and second[6]["weights_id"] != ckpt["weights_id"]


def test_engine_refuses_a_cache_built_for_another_model(tiny_model):
    cc = CacheConfig(block_tokens=16, device="cpu", swa_capacity_bytes=1 << 24)
    cache = PrefixCache.for_model(tiny_model, cc)
    other_seed = Model.synthetic(TINY, seed=1)
    no_rotation = Model.synthetic(TINY, seed=0, indexer_rotation=False)
    other_config = Model.synthetic(TINY.replace(rms_norm_eps=1e-5), seed=0)
    for m in (other_seed, no_rotation, other_config):
        with pytest.raises(ValueError, match="another model"):
            Engine(m, cache=cache)
    # A cache built from the config alone (the old README) names no weights: refused too.
    with pytest.raises(ValueError, match="for_model"):
        Engine(tiny_model, cache=PrefixCache(TINY, cc))
    # The same weights built again are the same model: they share the GPU and SWA tiers.
    a = Engine(tiny_model, cache=cache, replay="exact").generate([PROMPT[:50]], SP)[0]
    b = Engine(Model.synthetic(TINY, seed=0), cache=cache, replay="exact").generate([PROMPT[:50]], SP)[0]
    assert a.stats.path == "cold" and b.stats.gpu_hit_tokens == 48 and b.output_tokens == a.output_tokens


def test_model_without_weights_identity_keeps_to_memory_and_to_itself(tmp_path):
    model = Model.synthetic(TINY, seed=0)
    model.weights_id = None                     # weights set by hand, never identified
    store = tmp_path / "store"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PrefixCache.for_model(model, CacheConfig(block_tokens=16, device="cpu", swa_capacity_bytes=1 << 24,
                                                         store_dir=str(store)))
    msgs = [str(w.message) for w in caught if issubclass(w.category, StoreDisabledWarning)]
    assert len(msgs) == 1 and "no weights identity" in msgs[0] and "dsv41 digest" in msgs[0]
    assert cache.store is None and not store.exists()           # the store is never touched
    eng = Engine(model, cache=cache)
    eng.generate([PROMPT[:50]], SP)
    assert eng.generate([PROMPT[:50]], SP)[0].stats.gpu_hit_tokens == 48   # memory tiers work
    twin = Model.synthetic(TINY, seed=1)
    twin.weights_id = None                      # same config, unknown (other) weights
    with pytest.raises(ValueError, match="no weights identity"):
        Engine(twin, cache=cache)
    # An operator-given identity turns the store on.
    model.weights_id = "acme/tiny@rev3"
    with PrefixCache.for_model(model, CacheConfig(block_tokens=16, device="cpu", swa_capacity_bytes=0,
                                                  store_dir=str(store), store_durability="none")) as c2:
        assert c2.store is not None and c2.weights_id == "acme/tiny@rev3"


def test_weights_identity_of_synthetic_models():
    a, b = Model.synthetic(TINY, seed=0), Model.synthetic(TINY, seed=0)
    assert a.weights_id == b.weights_id and a.weights_id.startswith("synthetic:")
    assert Model.synthetic(TINY, seed=1).weights_id != a.weights_id
    assert Model.synthetic(TINY.replace(rms_norm_eps=1e-5), seed=0).weights_id != a.weights_id
    assert torch.equal(a.head.weight, b.head.weight)
