"""Remote tier benchmarks, measured in one run (ratios), JSON out.

1. get / put of block payloads through the remote tier (record encode + CRC-32C on put;
   get + verification of every block on get; deadlines and breaker included) against the
   backend's raw client moving the same payloads, batch by batch in the same run, rotating
   who goes first. The raw side runs every batch call its client has (Mooncake `put_batch`
   / `get_batch` on Python buffers and `batch_put_from` / `batch_get_into` on memory
   registered up front; Redis one `MSET` / one `MGET` per batch) and the baseline of each op
   is the fastest of them in this run. Both sides start from / end in the same place: puts
   take the rows of one uint8 [n, P] array, gets deliver one uint8 [n, P] array (the raw
   client's values joined or read in place, the tier's verified rows). Ratios: of the
   median batch times, of the totals, and the median of each back-to-back pair's ratio
   (robust to load changes on a shared box). Payloads: global KV blocks exported from a
   prefill of the model preset (real bytes), and random bytes of one v41-flash block.
   Target: tier / raw throughput >= 0.8.
2. What verification costs: the tier's batch check (chain ids + verify_records) and the
   one-value verify_record on the same values (us per block).
3. Resume TTFT through the engine: cold prefill vs a resume from the local tiers (global KV
   from the SSD store, snapshot from the host SWA pool, fresh GPU pool) vs a resume from the
   remote tier alone (global KV from Mooncake, snapshot from Redis, fresh process-equivalent
   cache), for a few prefix lengths.

    PYTHONPATH=python python bench/bench_remote.py --json bench/results/remote-....json

Starts its own Mooncake master + storage process + redis-server on loopback (or uses
--blocks/--snapshots URLs) and stops them by PID. Progress on stderr.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)

import dsv41  # noqa: E402
from dsv41 import Model, ModelConfig  # noqa: E402
from dsv41.cache import BlockLayout, CacheConfig, PrefixCache  # noqa: E402
from dsv41.engine.cache_adapter import export_blocks  # noqa: E402
from dsv41.cache.remote.record import chain_ids, verify_record, verify_records  # noqa: E402
from dsv41.cache.remote.redis import SMALL_VALUE_BYTES  # noqa: E402
from dsv41.cache.remote.servers import LocalServers  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench_remote] {msg}", file=sys.stderr, flush=True)


def _loadavg() -> float:
    return os.getloadavg()[0]


def real_payloads(model: Model, block: int, nblocks: int, seed: int) -> np.ndarray:
    """uint8 [nblocks, block_bytes]: the global KV blocks of a prefill of random tokens."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.config.vocab_size, (nblocks * block,), generator=g).tolist()
    state = model.new_state()
    model.prefill(toks, state)
    layout = BlockLayout(model.config, block)
    return export_blocks(layout, state, 0, nblocks).numpy()


def _cache(model_config, servers, block, weights_id="bench", **kw) -> PrefixCache:
    cc = CacheConfig(block_tokens=block, device="cpu", gpu_capacity_bytes=1 << 28, swa_capacity_bytes=1 << 28,
                     remote_blocks=servers.blocks_url, remote_snapshots=servers.snapshots_url,
                     remote_lookup_timeout_s=5.0, remote_write_timeout_s=10.0, **kw)
    c = PrefixCache(model_config, cc, weights_id=weights_id)
    assert c.remote.wait_connected(30.0)
    return c


def _alternate(i: int, tier, raws: list) -> None:
    """Runs turn i of the tier and of each raw method back to back, rotating who goes first.
    i counts batches over the whole run, not within a repetition: with 2 batches per
    repetition and 3 calls, a count per repetition put the tier first in every repetition's
    first batch (right after the previous repetition's keys were removed) and one raw method
    never first, so a cost of going first fell on the tier alone."""
    calls = [tier] + raws
    k = i % len(calls)
    for f in calls[k:] + calls[:k]:
        f()


def _raw_ops(scheme: str, raw, payloads: np.ndarray):
    """({"put": {name: f}, "get": {name: f}}, release): the raw client's batch calls on the
    payload rows s:e (f(keys, s, e); a get returns the blocks as one uint8 [n, P] array),
    and what frees their set-up. Mooncake: put_batch / get_batch on Python buffers, and
    batch_put_from / batch_get_into on memory registered with the client once, up front (its
    zero-copy path). Redis: one MSET / one MGET (small values as bytes, sent with the
    command as the tier does; else views of the rows: whichever redis-py moves fastest)."""
    n, P = payloads.shape
    if scheme == "redis":
        value = (lambda row: row.tobytes()) if P <= SMALL_VALUE_BYTES else memoryview
        return ({"put": {"mset": lambda keys, s, e: raw.mset(dict(zip(keys, (value(payloads[i]) for i in range(s, e)))))},
                 "get": {"mget": lambda keys, s, e: np.frombuffer(b"".join(raw.mget(keys)), np.uint8).reshape(-1, P)}},
                lambda: None)
    src, dst = np.ascontiguousarray(payloads), np.empty_like(payloads)
    for a in (src, dst):
        assert raw.register_buffer(a.ctypes.data, a.nbytes) == 0

    def put_batch(keys, s, e):
        assert raw.put_batch(keys, [memoryview(payloads[i]) for i in range(s, e)]) == 0

    def put_from(keys, s, e):
        assert all(rc == 0 for rc in raw.batch_put_from(keys, [src.ctypes.data + i * P for i in range(s, e)],
                                                         [P] * (e - s)))

    def get_batch(keys, s, e):
        return np.frombuffer(b"".join(raw.get_batch(keys)), np.uint8).reshape(-1, P)

    def get_into(keys, s, e):
        assert all(got == P for got in raw.batch_get_into(keys, [dst.ctypes.data + i * P for i in range(s, e)],
                                                          [P] * (e - s)))
        return dst[s:e]

    def release():
        for a in (src, dst):
            raw.unregister_buffer(a.ctypes.data)
    # Each method gets its own keys, so put_from and get_into read what they wrote.
    return ({"put": {"put_batch": put_batch, "put_from": put_from},
             "get": {"get_batch": get_batch, "get_into": get_into}}, release)


def bench_io(args, servers, model_config, payloads: np.ndarray, label: str) -> dict:
    """Tier vs raw client, per backend, on `payloads` (uint8 [n, block_bytes])."""
    block = args.block_tokens
    n, P = payloads.shape
    layout = BlockLayout(model_config, block)
    if layout.block_bytes != P:   # random payloads of another preset's size: a layout-free cache
        model_config = {"v41-flash": ModelConfig.preset("v41-flash")}.get(label.split(":")[0], model_config)
    out = {"payload": label, "block_bytes": P, "blocks": n, "batch_blocks": args.batch, "backends": {}}
    for role in ("blocks", "snapshots"):
        c = _cache(model_config, servers, block, weights_id=f"bench-{label}-{role}")
        if c.layout.block_bytes != P:
            c.close()
            raise SystemExit(f"layout mismatch {c.layout.block_bytes} != {P}")
        guard = c.remote.blocks if role == "blocks" else c.remote.snapshots
        be = guard.backend
        raw = be.client
        res = {"backend": be.scheme, "tier_put_s": [], "tier_get_s": [], "verify_s": [], "verify_one_s": []}
        # The raw client's batch calls (every one it has for moving many values, where it has
        # more than one); the baseline of each op is the fastest of them in this run.
        raw_ops, release = _raw_ops(be.scheme, raw, payloads)
        for op, methods in raw_ops.items():
            for name in methods:
                res[f"raw_{op}_{name}_s"] = []
        nbatch = len(range(0, n, args.batch))
        for rep in range(args.repeat + 1):
            ns = f"r{rep}"
            tok = np.random.default_rng(rep).integers(0, 30000, size=(n, block), dtype=np.uint32)
            key = c.key(ns)
            hashes = c.hasher.hash_blocks(tok.reshape(-1), key)
            root = c.hasher.root(key)
            raw_keys = {name: [f"raw:{label}:{role}:{rep}:{name}:{i}" for i in range(n)] for name in raw_ops["put"]}
            read_keys = dict(zip(raw_ops["get"], raw_keys.values()))   # get method i reads put method i's keys
            for bi, s in enumerate(range(0, n, args.batch)):
                e = min(n, s + args.batch)

                def tier_put():  # records (header, CRC-32C) through the guard, as the writer does (_put_blocks)
                    t0 = time.perf_counter()
                    keys, batch = c.remote.block_batch(key, ns, hashes, tok, range(s, e), payloads, 0, root)
                    guard.call("put_records", 10.0, keys, batch)
                    res["tier_put_s"].append(time.perf_counter() - t0)
                def raw_put(name, f):   # the raw client, the bare payload rows
                    t0 = time.perf_counter()
                    f(raw_keys[name][s:e], s, e)
                    res[f"raw_put_{name}_s"].append(time.perf_counter() - t0)
                _alternate(rep * nbatch + bi, tier_put,
                           [(lambda name=name, f=f: raw_put(name, f)) for name, f in raw_ops["put"].items()])
            for bi, s in enumerate(range(0, n, args.batch)):
                e = min(n, s + args.batch)

                def tier_get():  # get, verify, deliver the payloads as one array (what promotion needs)
                    t0 = time.perf_counter()
                    saved = c.remote.blocks
                    c.remote.blocks = guard   # the lookup path, on this role's backend
                    try:
                        got = c.remote.load_blocks(key, ns, hashes[: e], tok[: e], s, root)
                    finally:
                        c.remote.blocks = saved
                    res["tier_get_s"].append(time.perf_counter() - t0)
                    assert len(got) == e - s and np.array_equal(got, payloads[s:e]), "tier get incomplete"

                def raw_get(name, f):   # the raw client's batch get, the blocks as one uint8 [n, P] array
                    t0 = time.perf_counter()
                    arr = f(read_keys[name][s:e], s, e)
                    res[f"raw_get_{name}_s"].append(time.perf_counter() - t0)
                    assert np.array_equal(arr, payloads[s:e]), f"raw {name} get incomplete"
                _alternate(rep * nbatch + bi, tier_get,
                           [(lambda name=name, f=f: raw_get(name, f)) for name, f in raw_ops["get"].items()])
            # verification alone, on values fetched once: what the tier runs per lookup (chain
            # ids + the batch check) and the one-value check it falls back to
            vals = guard.call("get", 10.0, c.remote.block_keys(ns, hashes))
            for s in range(0, n, args.batch):
                e = min(n, s + args.batch)
                t0 = time.perf_counter()
                chain = chain_ids(tok[:e], key)
                rows, status = verify_records(vals[s:e], key=key, start=s, hashes=hashes[s:e],
                                              parent_hash=hashes[s - 1] if s else root, chain=chain[s:],
                                              parent_chain=chain[s - 1] if s else 0, tokens=tok[s:e], payload_bytes=P)
                res["verify_s"].append(time.perf_counter() - t0)
                assert status is None and len(rows) == e - s
            chain = chain_ids(tok, key)
            t0 = time.perf_counter()
            for i, v in enumerate(vals):
                ver = verify_record(v, key=key, block_index=i, block_hash=hashes[i],
                                    parent_hash=hashes[i - 1] if i else root, parent_chain=chain[i - 1] if i else 0,
                                    chain_id=chain[i], tokens=tok[i], payload_bytes=P)
                assert ver.status == "ok"
            res["verify_one_s"].append(time.perf_counter() - t0)
            # Both sides' keys go, so every repetition allocates under the same conditions.
            gone = c.remote.block_keys(ns, hashes) + [k for ks in raw_keys.values() for k in ks]
            if be.scheme == "mooncake":
                raw.batch_remove(gone, force=True)
            else:
                raw.delete(*gone)
            if rep == 0:   # warm-up: connections, server allocations, first-touch pages
                for k in res:
                    if k.endswith("_s"):
                        res[k].clear()
        release()
        # The baseline of each op: the raw method with the lowest median batch time.
        res["raw_methods"] = {op: {name: statistics.median(res[f"raw_{op}_{name}_s"]) for name in methods}
                              for op, methods in raw_ops.items()}
        res["raw_best"] = {op: min(t, key=t.get) for op, t in res["raw_methods"].items()}
        for op, methods in raw_ops.items():
            for name in methods:
                series = res.pop(f"raw_{op}_{name}_s")
                if name == res["raw_best"][op]:
                    res[f"raw_{op}_s"] = series
        tot = {k: sum(v) for k, v in res.items() if k.endswith("_s")}
        nbytes = n * P * args.repeat
        res["mb_per_s"] = {k[:-2]: nbytes / tot[k] / 1e6 for k in tot}
        med = {k: statistics.median(res[k]) for k in tot}
        # Throughput ratio from the median batch (the box is shared: a load spike in one batch
        # should not decide it); the ratio of totals beside it.
        res["tier_over_raw"] = {"put": med["raw_put_s"] / med["tier_put_s"], "get": med["raw_get_s"] / med["tier_get_s"]}
        # ... and the median of each batch's own ratio (tier and raw batches run back to back,
        # so a load change between batches cancels out)
        res["tier_over_raw_paired"] = {op: statistics.median(r / t for r, t in zip(res[f"raw_{op}_s"], res[f"tier_{op}_s"]))
                                       for op in ("put", "get")}
        res["tier_over_raw_totals"] = {"put": tot["raw_put_s"] / tot["tier_put_s"],
                                       "get": tot["raw_get_s"] / tot["tier_get_s"]}
        res["verify_us_per_block"] = tot["verify_s"] / (n * args.repeat) * 1e6
        res["verify_one_us_per_block"] = tot["verify_one_s"] / (n * args.repeat) * 1e6
        res["verify_share_of_tier_get"] = tot["verify_s"] / tot["tier_get_s"]
        for k in ("tier_put_s", "raw_put_s", "tier_get_s", "raw_get_s", "verify_s", "verify_one_s"):
            res[k] = {"median_batch_s": statistics.median(res[k]), "total_s": tot[k]}
        log(f"{label} {be.scheme}: put tier/raw {res['tier_over_raw']['put']:.2f} (paired "
            f"{res['tier_over_raw_paired']['put']:.2f}), get tier/raw {res['tier_over_raw']['get']:.2f} (paired "
            f"{res['tier_over_raw_paired']['get']:.2f}), verify {res['verify_us_per_block']:.1f} us/block "
            f"(one by one {res['verify_one_us_per_block']:.1f})")
        out["backends"][role] = res
        c.close()
    return out


def bench_resume(args, servers, model: Model) -> list[dict]:
    from dsv41.engine import Engine, SamplingParams
    cfg, B = model.config, args.block_tokens
    g = torch.Generator().manual_seed(args.seed + 7)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-bench-remote-"))
    try:
        for n in args.prefixes:
            prefix = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
            tail = torch.randint(0, cfg.vocab_size, (args.suffix,), generator=g).tolist()
            # A fresh weights identity per prefix (an operator may name weights): nothing an
            # earlier run left in the servers can hit, so "cold" is cold.
            model.weights_id = f"resume-{n}-{time.time_ns()}"
            store = tmp / f"ssd-{n}"

            def cache(local_ssd: bool, remote: bool) -> PrefixCache:
                cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 28, swa_capacity_bytes=1 << 28,
                                 store_dir=str(store) if local_ssd else None, store_durability="none",
                                 store_direct_io=False,
                                 remote_blocks=servers.blocks_url if remote else None,
                                 remote_snapshots=servers.snapshots_url if remote else None,
                                 remote_lookup_timeout_s=args.lookup_timeout_ms / 1e3)
                c = PrefixCache.for_model(model, cc)
                if remote:
                    assert c.remote.wait_connected(30.0)
                return c

            log(f"resume TTFT, prefix {n}: cold (and writing every tier)")
            w = cache(True, True)
            cold = Engine(model, cache=w, replay="bounded").generate([prefix], sp)[0]
            w.remote.flush(60.0)
            m = w.match(prefix, max_tokens=n)   # the snapshot at the end of the prompt
            snap, snap_tokens = m.snapshot, (m.snapshot.num_tokens if m.snapshot else 0)
            w.release(m)
            w.close()
            prompt = prefix + tail
            log(f"resume TTFT, prefix {n}: local SSD + host SWA pool")
            loc = cache(True, False)
            if snap is not None:
                loc.put_snapshot(prefix[:snap_tokens], snap)
            lo = Engine(model, cache=loc, replay="bounded").generate([prompt], sp)[0]
            loc.close()
            log(f"resume TTFT, prefix {n}: remote tier only")
            rem = cache(False, True)
            ro = Engine(model, cache=rem, replay="bounded").generate([prompt], sp)[0]
            rm = {k: v for k, v in rem.metrics.to_dict().items() if k.startswith("dsv41_cache_remote_h")}
            rem.close()
            log(f"resume TTFT, prefix {n}: cold")
            co = Engine(model).generate([prompt], sp)[0]
            row = {"prefix_tokens": n, "suffix_tokens": args.suffix, "first_prefill_ttft_s": cold.stats.ttft_s}
            for name, o in (("cold", co), ("local_ssd", lo), ("remote", ro)):
                s = o.stats
                row[name] = {"path": s.path, "ttft_s": s.ttft_s, "prefill_tokens": s.prefill_tokens,
                             "global_hit_tokens": s.global_hit_tokens, "swa_hit_tokens": s.swa_hit_tokens,
                             "ssd_hit_tokens": s.ssd_hit_tokens, "first_token": o.output_tokens[:1]}
            row["remote_hits"] = rm
            row["same_first_token"] = co.output_tokens[:1] == lo.output_tokens[:1] == ro.output_tokens[:1]
            row["cold_over_remote"] = co.stats.ttft_s / ro.stats.ttft_s
            row["local_over_remote"] = lo.stats.ttft_s / ro.stats.ttft_s
            log(f"prefix {n}: TTFT cold {co.stats.ttft_s * 1e3:.0f} ms, local SSD {lo.stats.ttft_s * 1e3:.0f} ms "
                f"({lo.stats.path}), remote {ro.stats.ttft_s * 1e3:.0f} ms ({ro.stats.path})")
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-tiny")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=128, help="blocks per get/put measurement")
    ap.add_argument("--batch", type=int, default=16, help="blocks per call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefixes", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--lookup-timeout-ms", type=float, default=500.0)
    ap.add_argument("--segment-mb", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no contention on a shared box)")
    ap.add_argument("--skip-io", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    commit = git_commit()
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "command": "python bench/bench_remote.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "dsv41": dsv41.__version__,
           "args": vars(args), "loadavg_start": _loadavg()}
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.preset(args.preset)
    model = Model.synthetic(cfg, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="dsv41-bench-servers-") as d, \
            LocalServers(d, segment_bytes=args.segment_mb << 20, redis_maxmemory="2gb") as servers:
        out["servers"] = {"blocks": servers.blocks_url, "snapshots": servers.snapshots_url,
                          "segment_mb": args.segment_mb}
        if not args.skip_io:
            log(f"exporting {args.blocks} real blocks of {args.preset}")
            real = real_payloads(model, args.block_tokens, args.blocks, args.seed)
            flash = np.random.default_rng(args.seed).integers(
                0, 256, size=(args.blocks, BlockLayout(ModelConfig.preset("v41-flash"), args.block_tokens).block_bytes),
                dtype=np.uint8)
            out["io"] = [bench_io(args, servers, cfg, real, f"{args.preset}:exported"),
                         bench_io(args, servers, ModelConfig.preset("v41-flash"), flash, "v41-flash:random")]
        if not args.skip_resume:
            out["resume_ttft"] = bench_resume(args, servers, model)
    out["loadavg_end"] = _loadavg()
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
