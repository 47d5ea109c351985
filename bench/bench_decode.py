"""Decode steps of the paged runtime against the per-sequence runtime, in the same run.

For each batch size, B sequences are prefilled to --context tokens, then decode steps are
timed: the paged step (engine/paged_runner.PagedRunner: the batch built on the host, one
forward over every sequence; on a GPU replayed as a CUDA graph, and also run eagerly for
comparison) and the per-sequence step (Model.decode_batch over SequenceStates, the
baseline). One step of each is also run under dsv41.opcount.OpCounter: aten ops and
launches per step and per layer, and host synchronizations (the CPU's view of a GPU's
launches and stalls), counted with the CPU-only shortcuts off (dsv41.cpu_shortcuts: the
ops a GPU would launch; `*_ops`) and on (as this device runs the step; `*_cpu_ops`). On a GPU it also counts the kernels of a step (torch.profiler),
times prefill throughput at --prefill-lengths, and records peak memory.

    OMP_NUM_THREADS=1 PYTHONPATH=python python bench/bench_decode.py --preset v41-small \\
        --batches 1 16 --context 1024 --json bench/results/decode-cpu-DATE.json
    python bench/bench_decode.py --device cuda --json out.json    # the GPU defaults
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)

from dsv41 import Model, ModelConfig, cpu_shortcuts  # noqa: E402
from dsv41.cache.global_pool import GlobalKVPool  # noqa: E402
from dsv41.cache.layout import BlockLayout  # noqa: E402
from dsv41.config.flash_width import flash_width  # noqa: E402
from dsv41.engine.paged_kv import PagedMemory  # noqa: E402
from dsv41.engine.paged_runner import PagedRunner  # noqa: E402
from dsv41.model.paged import SeqChunk  # noqa: E402
from dsv41.opcount import OpCounter  # noqa: E402

PAGE = 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PagedSeqs:
    """B sequences on a PagedMemory, stepped through a PagedRunner."""

    def __init__(self, model, batch: int, context: int, steps: int, *, graphs: bool,
                 chunk: int):
        tokens = context + steps + 8
        pages = batch * (-(-tokens // PAGE) + 1) + 4
        layout = BlockLayout(model.config, PAGE)
        pool = GlobalKVPool(layout, pages * layout.block_bytes, device=model.device)
        self.mem = PagedMemory(model, pool, max_seqs=batch, max_step_tokens=chunk + batch)
        self.runner = PagedRunner(model, self.mem, graphs=graphs)
        self.kvs = [self.mem.open() for _ in range(batch)]
        self.chunk = chunk

    def prefill(self, prompts: list[list[int]]) -> None:
        for kv, p in zip(self.kvs, prompts):
            for at in range(0, len(p), self.chunk):
                part = p[at: at + self.chunk]
                self.mem.ensure(kv, kv.position + len(part))
                self.runner.run([SeqChunk(part, kv.position, kv.slot, kv.pages,
                                          logits=at + len(part) == len(p))])
                kv.position += len(part)
                kv.tokens += part

    def chunks(self, token: int) -> list[SeqChunk]:
        out = []
        for kv in self.kvs:
            self.mem.ensure(kv, kv.position + 1)
            out.append(SeqChunk([token], kv.position, kv.slot, kv.pages))
        return out

    def step(self, token: int) -> torch.Tensor:
        out = self.runner.run(self.chunks(token))
        for kv in self.kvs:
            kv.position += 1
            kv.tokens.append(token)
        return out[-1]


def _time(fn, n: int, device) -> list[float]:
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _count(fn, layers: int) -> dict:
    with OpCounter() as c:
        fn()
    s = c.summary(12)
    return {"ops": s["ops"], "launches": s["launches"], "host_syncs": s["host_syncs"],
            "ops_per_layer": s["ops"] / layers, "launches_per_layer": s["launches"] / layers,
            "syncs": s["syncs"], "top_ops": s["top"]}


def _kernels(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _paged_variant(model, prompts, args, device, *, graphs: bool) -> dict:
    """The paged runtime on these prompts: eager, or as CUDA graphs on a GPU."""
    paged = PagedSeqs(model, len(prompts), args.context, 2 * args.steps + 8, graphs=graphs,
                      chunk=args.chunk)
    name = "paged_graphs" if graphs else "paged"
    t0 = time.perf_counter()
    paged.prefill(prompts)
    _sync(device)
    row = {f"{name}_prefill_s": time.perf_counter() - t0}
    paged.step(2)                                          # warm (and capture, with graphs)
    if not graphs:
        L = model.config.num_layers
        with cpu_shortcuts.off():            # the ops a GPU would launch
            paged.step(3)                    # warm this path's caches (cached views)
            row["paged_ops"] = _count(lambda: paged.step(3), L)
        row["paged_cpu_ops"] = _count(lambda: paged.step(3), L)   # as this device runs it
    row[f"{name}_ms"] = _time(lambda: paged.step(4), args.steps, device)
    row[f"{name}_kernels"] = _kernels(lambda: paged.step(5), device)
    row[f"{name}_counters"] = dict(paged.runner.counters)
    return row


def bench_batch(model, batch: int, args, device) -> dict:
    c = model.config
    L = c.num_layers
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, c.vocab_size, (args.context,), generator=g).tolist()
               for _ in range(batch)]
    row = {"batch": batch, "context": args.context}
    if batch <= args.baseline_max_batch:               # baseline: the per-sequence runtime
        states = [model.new_state() for _ in range(batch)]
        for st, p in zip(states, prompts):
            for at in range(0, len(p), args.chunk):
                model.prefill(p[at: at + args.chunk], st)

        def ref_step():
            model.decode_batch([1] * batch, states)
        ref_step()                                         # warm (caches, kernels)
        with cpu_shortcuts.off():
            ref_step()
            row["reference_ops"] = _count(ref_step, L)
        row["reference_cpu_ops"] = _count(ref_step, L)
        row["reference_ms"] = _time(ref_step, args.baseline_steps, device)
        del states
    for graphs in ([False, True] if device.type == "cuda" else [False]):
        row.update(_paged_variant(model, prompts, args, device, graphs=graphs))
    med = {k: statistics.median(v) for k, v in row.items() if k.endswith("_ms")}
    row["median_ms"] = med
    if "reference_ms" in med:
        row["ratio_paged_vs_reference"] = med["reference_ms"] / med["paged_ms"]
    if "paged_graphs_ms" in med:
        row["ratio_graphs_vs_eager"] = med["paged_ms"] / med["paged_graphs_ms"]
    row["ops_ratio_vs_batch1"] = None
    return row


def bench_prefill(model, lengths: list[int], args, device) -> list[dict]:
    rows = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        p = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        paged = PagedSeqs(model, 1, n, 4, graphs=False, chunk=args.chunk)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        paged.prefill([p])
        _sync(device)
        dt = time.perf_counter() - t0
        row = {"tokens": n, "chunk": args.chunk, "seconds": dt, "tokens_per_s": n / dt}
        if device.type == "cuda":
            row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        rows.append(row)
        del paged
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v41-small")
    ap.add_argument("--flash-layers", type=int, default=None,
                    help="instead of --preset: v41-flash's widths on this many layers")
    ap.add_argument("--flash-experts", type=int, default=16,
                    help="routed experts of the Flash-width model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--baseline-max-batch", type=int, default=None,
                    help="time the per-sequence baseline up to this batch (its step grows "
                         "with the batch; default 8 on a GPU, 16 on the CPU)")
    ap.add_argument("--baseline-steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--prefill-lengths", type=int, nargs="*", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.batches = args.batches or ([1, 8, 64, 256] if gpu else [1, 16])
    args.steps = args.steps or (50 if gpu else 10)
    if args.baseline_max_batch is None:
        args.baseline_max_batch = 8 if gpu else 16
    if args.prefill_lengths is None:
        args.prefill_lengths = [4096, 16384, 65536] if gpu else []
    try:
        cfg = (flash_width(args.flash_layers, args.flash_experts) if args.flash_layers
               else ModelConfig.preset(args.preset))
    except ValueError as e:
        raise SystemExit(f"bench_decode: {e}")
    torch.manual_seed(0)
    model = Model.synthetic(cfg, seed=0, device=device, precision="bf16")
    out = {"bench": "decode", "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "command": "bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "preset": cfg.name, "device": str(device),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads(),
                       "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
                       "gpu": torch.cuda.get_device_name(device) if gpu else None},
           "args": vars(args), "batches": [], "prefill": []}
    for b in args.batches:
        row = bench_batch(model, b, args, device)
        out["batches"].append(row)
        med, ops = row["median_ms"], row["paged_ops"]
        line = (f"batch {b}: paged {med['paged_ms']:.2f} ms/step"
                + (f", graphs {med['paged_graphs_ms']:.2f}" if "paged_graphs_ms" in med else "")
                + f"; ops/layer {ops['ops_per_layer']:.1f}, host syncs {ops['host_syncs']}")
        if "reference_ms" in med:
            ref = row["reference_ops"]
            line += (f"; per-sequence {med['reference_ms']:.2f} ms "
                     f"({row['ratio_paged_vs_reference']:.2f}x), ops/layer "
                     f"{ref['ops_per_layer']:.1f}, host syncs {ref['host_syncs']}")
        print(line, flush=True)
    first = out["batches"][0]["paged_ops"]["ops"] if out["batches"] else None
    for row in out["batches"]:
        row["ops_ratio_vs_batch1"] = row["paged_ops"]["ops"] / first if first else None
    out["prefill"] = bench_prefill(model, args.prefill_lengths, args, device)
    for r in out["prefill"]:
        print(f"prefill {r['tokens']}: {r['tokens_per_s']:.0f} tokens/s", flush=True)
    out["machine"]["load_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
