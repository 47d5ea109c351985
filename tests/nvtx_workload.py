"""Run by tests/test_profiling.py in a subprocess with DSV41_NVTX=1 and the recorder tool
(tests/nvtx_recorder.c) injected into NVTX: every cache path through the engine, then
calls that raise inside ranges, then a switch-off inside an open range. Prints one JSON
object: the engine's own statistics, which the test compares with the recorded payloads.

    python tests/nvtx_workload.py STORE_DIR
"""
from __future__ import annotations

import json
import sys

import torch

from dsv41 import formats, profiling
from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.errors import PayloadError
from dsv41.config import ModelConfig
from dsv41.engine import Engine, SamplingParams
from dsv41.model import Model

BLOCK = 16


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_cache(model, store: str, clock: Clock) -> PrefixCache:
    cc = CacheConfig(block_tokens=BLOCK, device="cpu", gpu_capacity_bytes=1 << 24,
                     swa_capacity_bytes=1 << 26, swa_ttl_s=10.0, store_dir=store,
                     store_durability="none", store_direct_io=False)
    return PrefixCache.for_model(model, cc, clock=clock)


def stats(o) -> dict:
    s = o.stats
    return {"path": s.path, "prompt_tokens": s.prompt_tokens, "prefill_tokens": s.prefill_tokens,
            "replayed_tokens": s.replayed_tokens, "ssd_hit_tokens": s.ssd_hit_tokens,
            "output_tokens": len(o.output_tokens)}


def main(store: str) -> None:
    out = {"enabled": profiling.enabled()}
    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    sp = SamplingParams(max_new_tokens=3)
    clock = Clock()
    p = tokens(1, 70)
    with make_cache(model, store, clock) as cache:
        eng = Engine(model, cache=cache)
        cold = eng.generate([p], sp)[0]
        nxt = p + cold.output_tokens + tokens(2, 9)
        both = eng.generate([nxt], sp)[0]
        clock.t = 100.0                          # the SWA snapshots expire
        replay = eng.generate([nxt + both.output_tokens + tokens(3, 5)], sp)[0]
        # a real error inside a range: payloads of the wrong size
        try:
            cache.insert(p, torch.zeros(1, 3, dtype=torch.uint8))
        except PayloadError:
            out["insert_raised"] = True
    # a new process's view (SSD tier only), on the reference runtime: the paged runtime maps
    # pages in place, the reference one reads them out (cache.read_blocks); both are traced
    with make_cache(model, store, Clock()) as cache:
        ssd = Engine(model, cache=cache, runtime="reference").generate([p], sp)[0]
    out["runs"] = {"cold": stats(cold), "both_hit": stats(both), "encoder_replay": stats(replay),
                   "ssd": stats(ssd)}
    # an op raising inside nested ranges
    try:
        with profiling.scope("test.outer", tokens=3):
            formats.quantize_nvfp4(torch.zeros(3, 7))
    except ValueError:
        out["op_raised"] = True
    # switched off inside an open range: that range still ends, nothing inside is emitted
    with profiling.scope("test.toggle"):
        profiling.disable()
        formats.quantize_nvfp4(torch.zeros(2, 16))
    out["enabled_after_disable"] = profiling.enabled()
    with profiling.scope("test.after_toggle"):
        pass
    out["reenabled"] = profiling.enable()
    with profiling.scope("test.reenabled"):
        pass
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
