"""The prefix cache's tier paths, each against a baseline measured in the same run:

  promote  PrefixCache.match of a 4K / 64K-token prefix held only on the SSD (v41-flash
           blocks): the store's verified read into a reused staging buffer and one pool write
           per promotion, against the same with a staging buffer allocated per call (what
           _promote did before the tier protocol), and against the floor: store.load alone
           into a preallocated buffer. Rounds alternate who goes first.
  adopt    the request-path latency of caching a new 4K / 64K-token prefix whose KV is in
           private pool pages (adopt: publish, queue the SSD job) against insert() of the
           same prefix from a payload tensor (pool write, SSD records queued), SSD
           write-behind on; and flush(), when the blocks are acknowledged, after each.

    python bench/bench_tiers.py --json bench/results/bench_tiers_cpu_DATE_COMMIT.json
    python bench/bench_tiers.py --only promote --repeat 9

On a CPU the pool is host memory, so these measure the host paths only (pageable staging:
the pinned buffer a CUDA pool uses is far costlier to allocate, which only a GPU run shows).
Numbers on shared machines move from run to run: read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)
import dsv41  # noqa: E402
from dsv41.cache import CacheConfig, PrefixCache  # noqa: E402
from dsv41.cache.tiers.staging import StagingRows  # noqa: E402
from dsv41.config import ModelConfig  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cache(args, root: str, blocks: int, **kw) -> PrefixCache:
    cfg = ModelConfig.preset(args.preset)
    probe = PrefixCache(cfg, CacheConfig(block_tokens=args.block_tokens, gpu_capacity_bytes=1 << 30, device="cpu",
                                         swa_capacity_bytes=0))
    bb = probe.layout.block_bytes
    cc = CacheConfig(block_tokens=args.block_tokens, gpu_capacity_bytes=(blocks + 8) * bb, device="cpu",
                     swa_capacity_bytes=0, store_dir=root, store_durability=args.durability, **kw)
    return PrefixCache(cfg, cc, weights_id="bench-tiers")


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def bench_promote(args, out: dict) -> None:
    rows = []
    for tokens in args.chain_tokens:
        root = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir)
        try:
            nb = tokens // args.block_tokens
            cache = _cache(args, root, nb)
            bb = cache.layout.block_bytes
            rng = np.random.default_rng(tokens)
            prompt = rng.integers(0, cache.config.vocab_size, tokens).astype("<u4")
            payloads = torch.from_numpy(rng.integers(0, 256, (nb, bb), dtype=np.uint8))
            cache.release(cache.insert(prompt, payloads))
            cache.flush()
            key = cache.key()
            hashes = cache.hasher.hash_blocks(prompt, key)
            tok = prompt.reshape(nb, args.block_tokens)
            floor_buf = np.empty((nb, bb), dtype=np.uint8)
            reuse, per_call = cache.ssd.staging, StagingRows(bb, "cpu", keep=0)

            def promote(staging) -> float:
                cache.pool.evict_all()
                cache.ssd.staging = staging
                t0 = time.perf_counter()
                m = cache.match(prompt)
                t = time.perf_counter() - t0
                assert m.ssd_blocks == nb
                cache.release(m)
                return t

            def floor() -> float:
                t0 = time.perf_counter()
                assert len(cache.store.load(key, hashes, tok, floor_buf)) == nb
                return time.perf_counter() - t0

            promote(reuse), promote(per_call), floor()   # warm: first reads, first buffers
            t = {"reuse": [], "per_call": [], "floor": []}
            for r in range(args.repeat):
                order = [("reuse", lambda: promote(reuse)), ("per_call", lambda: promote(per_call)),
                         ("floor", floor)]
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    t[name].append(fn())
            assert torch.equal(cache.read_blocks(cache.match(prompt)), payloads)
            row = {"tokens": tokens, "blocks": nb, "block_bytes": bb,
                   **{f"{k}_ms": _median_ms(v) for k, v in t.items()},
                   **{f"{k}_runs_ms": [x * 1e3 for x in v] for k, v in t.items()},
                   "reuse_over_floor": statistics.median(t["reuse"]) / statistics.median(t["floor"]),
                   "per_call_over_floor": statistics.median(t["per_call"]) / statistics.median(t["floor"]),
                   "per_call_over_reuse": statistics.median(t["per_call"]) / statistics.median(t["reuse"]),
                   "staging_allocations_reuse": reuse.allocations, "staging_allocations_per_call": per_call.allocations}
            rows.append(row)
            log(f"promote {tokens:>6} tokens: reuse {row['reuse_ms']:.2f} ms, per-call buffer {row['per_call_ms']:.2f} ms, "
                f"store.load alone {row['floor_ms']:.2f} ms (per-call/reuse {row['per_call_over_reuse']:.3f})")
            cache.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out["promote"] = rows


def bench_adopt(args, out: dict) -> None:
    rows = []
    for tokens in args.chain_tokens:
        root = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir)
        try:
            nb = tokens // args.block_tokens
            cache = _cache(args, root, 2 * nb)
            bb = cache.layout.block_bytes
            rng = np.random.default_rng(tokens + 1)

            def fresh():
                return (rng.integers(0, cache.config.vocab_size, tokens).astype("<u4"),
                        torch.from_numpy(rng.integers(0, 256, (nb, bb), dtype=np.uint8)))

            def by_insert() -> tuple[float, float]:
                prompt, payloads = fresh()
                t0 = time.perf_counter()
                m = cache.insert(prompt, payloads)
                t = time.perf_counter() - t0
                cache.release(m)
                t1 = time.perf_counter()
                cache.flush()
                return t, time.perf_counter() - t1

            def by_adopt() -> tuple[float, float]:
                prompt, payloads = fresh()
                pages = cache.pool.allocate(nb)
                cache.pool.write(pages, payloads)        # the prefill's own writes: not timed
                t0 = time.perf_counter()
                m = cache.adopt(prompt, pages)
                t = time.perf_counter() - t0
                cache.release(m)
                t1 = time.perf_counter()
                cache.flush()
                return t, time.perf_counter() - t1

            by_insert(), by_adopt()
            t = {"insert": [], "adopt": [], "insert_flush": [], "adopt_flush": []}
            for r in range(args.repeat):
                order = [("insert", by_insert), ("adopt", by_adopt)]
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    cache.pool.evict_all()
                    call, flush = fn()
                    t[name].append(call)
                    t[name + "_flush"].append(flush)
            row = {"tokens": tokens, "blocks": nb, "block_bytes": bb,
                   **{f"{k}_ms": _median_ms(v) for k, v in t.items()},
                   **{f"{k}_runs_ms": [x * 1e3 for x in v] for k, v in t.items()},
                   "adopt_over_insert": statistics.median(t["adopt"]) / statistics.median(t["insert"])}
            rows.append(row)
            log(f"adopt {tokens:>6} tokens: adopt {row['adopt_ms']:.2f} ms, insert {row['insert_ms']:.2f} ms "
                f"(ratio {row['adopt_over_insert']:.3f}); flush after: {row['adopt_flush_ms']:.1f} / "
                f"{row['insert_flush_ms']:.1f} ms")
            cache.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out["adopt"] = rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--only", choices=["promote", "adopt"], action="append", help="run only these sections")
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: the temp dir)")
    p.add_argument("--preset", default="v41-flash", help="model whose block size is used")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--chain-tokens", type=int, nargs="+", default=[4096, 65536])
    p.add_argument("--durability", choices=["fsync", "none"], default="none")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: no thread-pool wake-ups in the timings)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
           "host": platform.node(),
           "command": " ".join(["python", "bench/bench_tiers.py", *(argv if argv is not None else sys.argv[1:])]),
           "load_average_start": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "dsv41": dsv41.__version__, "args": vars(args)}
    for name in args.only or ["promote", "adopt"]:
        {"promote": bench_promote, "adopt": bench_adopt}[name](args, out)
    out["load_average_end"] = os.getloadavg()
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
