"""Batched global-KV block copies (dsv41::copy_blocks, one kernel for all pairs) between the
GPU pool and a pinned host pool, both ways, and within the GPU, against one cudaMemcpy of a
contiguous buffer of the same total size measured in the same run.

    python bench/bench_copy.py --device cuda --json out.json

Block sizes: 16 KiB, 57344 B (64 tokens x 896 B, about one V4.1 global-KV block) and
256 KiB; 256 MiB moved per call, pairs in random order. Both engines of the op are timed:
the SM kernel and the copy engines (cudaMemcpyBatchAsync, timed on a side stream: on the
legacy default stream the op falls back to one cudaMemcpyAsync per block). Target: >= 80% of the memcpy
rate. CUDA events time the stream, so the CPU cost of building a batch shows only where
it starves the stream.
"""
from __future__ import annotations

import sys

import torch

from _kernel_bench import parser, report, require_gpu, time_cuda, write_report

TOTAL = 256 << 20


def refcheck() -> dict:
    g = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (64, 4104), generator=g, dtype=torch.int64).to(torch.uint8).pin_memory()
    dev = torch.zeros(80, 4104, dtype=torch.uint8, device="cuda")
    src, dst = torch.randperm(64)[:50], torch.randperm(80)[:50]
    torch.ops.dsv41.copy_blocks(host, src, dev, dst)
    back = torch.zeros_like(host).pin_memory()  # copy_blocks takes pinned host pools only
    torch.ops.dsv41.copy_blocks(dev, dst, back, src)
    torch.cuda.synchronize()
    ok = torch.equal(dev.cpu()[dst], host[src]) and torch.equal(back[src], host[src])
    print(f"refcheck: bit-exact round trip {'ok' if ok else 'FAILED'}", file=sys.stderr)
    if not ok:
        raise SystemExit("refcheck failed: not timing a wrong kernel")
    return {"bit_exact": ok}


def time_block_size(block: int, side: torch.cuda.Stream) -> list[dict]:
    """memcpy, the kernel and the copy engines, each direction, TOTAL bytes in blocks of `block`."""
    rows = []
    n = TOTAL // block
    dev = torch.empty(2 * n, block, dtype=torch.uint8, device="cuda").random_(0, 255)
    host = torch.empty(2 * n, block, dtype=torch.uint8).pin_memory()
    host.random_(0, 255)
    dev2 = torch.empty_like(dev)
    si_h = torch.randperm(2 * n)[:n]
    di_h = torch.randperm(2 * n)[:n]
    si, di = si_h.cuda(), di_h.cuda()
    flat_dev = torch.empty(n * block, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(n * block, dtype=torch.uint8).pin_memory()
    pools = {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, dev2)}
    memcpys = {"h2d": lambda: flat_dev.copy_(flat_host, non_blocking=True),
               "d2h": lambda: flat_host.copy_(flat_dev, non_blocking=True),
               "d2d": lambda: dev2.view(-1)[: n * block].copy_(flat_dev)}
    for name, (a, b) in pools.items():
        t_m = time_cuda(memcpys[name], repeat=10, warmup=2)
        # kernel: device indices (what an engine would pass); copy engines: host indices.
        t_k = time_cuda(lambda: torch.ops.dsv41.copy_blocks(a, si, b, di, "kernel"), repeat=10, warmup=2)
        # The copy engines on a side stream: on torch's legacy default stream block_copy.cu
        # skips cudaMemcpyBatchAsync and issues one cudaMemcpyAsync per block, which would
        # time CPU submission. The engine (and any real caller) runs on its own stream.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            t_c = time_cuda(lambda: torch.ops.dsv41.copy_blocks(a, si_h, b, di_h, "copy_engine"),
                            repeat=10, warmup=2)
        row = {"direction": name, "block_bytes": block, "blocks": n, "bytes": n * block,
               "memcpy_s": t_m, "kernel_s": t_k, "copy_engine_s": t_c,
               "memcpy_GBps": n * block / t_m / 1e9, "kernel_GBps": n * block / t_k / 1e9,
               "copy_engine_GBps": n * block / t_c / 1e9,
               "kernel_fraction_of_memcpy": t_m / t_k, "copy_engine_fraction_of_memcpy": t_m / t_c}
        rows.append(row)
        print(f"  {name} block {block:7d} B x {n:6d}: memcpy {row['memcpy_GBps']:7.1f} GB/s, kernel "
              f"{row['kernel_GBps']:7.1f} ({row['kernel_fraction_of_memcpy']:.2f}), copy engines "
              f"{row['copy_engine_GBps']:7.1f} ({row['copy_engine_fraction_of_memcpy']:.2f})", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="16384,57344,262144")
    args = p.parse_args(argv)
    if not require_gpu("copy", args):
        return 0
    import dsv41  # noqa: F401

    check = refcheck() if args.refcheck else None
    side = torch.cuda.Stream()
    rows = []
    for block in [int(b) for b in args.blocks.split(",")]:
        rows += time_block_size(block, side)
        torch.cuda.empty_cache()  # the buffers of time_block_size are gone with its frame
    write_report(args.json, report("copy", rows, {"refcheck": check, "target": ">= 0.8 of memcpy"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
