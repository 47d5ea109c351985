"""Codec throughput: the dsv41 ops against the torch reference, and on a GPU against the
device's own copy bandwidth, all measured in the same run. Codecs: NVFP4, MXFP4, FP8 SWA
and the FP8 V4 main-KV entry (rope dims: 64, the V4-Flash split, when the dim allows it).

    python bench/bench_codecs.py                      # CPU op vs reference, JSON to stdout
    python bench/bench_codecs.py --json out.json      # also write the results
    python bench/bench_codecs.py --device cuda        # GPU kernels vs a device-to-device copy

Every row checks the fast path against the reference bit for bit before timing it
(--no-refcheck skips that). Ratios are what to read: these machines are noisy, absolute
numbers move from run to run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import dsv41  # noqa: E402
from _kernel_bench import time_cuda  # noqa: E402  (bench/ is on sys.path when run as a script)
from _meta import git_commit  # noqa: E402
from dsv41 import formats  # noqa: E402

CODECS = ("nvfp4", "mxfp4", "fp8_swa", "fp8_v4")
V4_ROPE_DIM = 64  # DeepSeek-V4-Flash's RoPE dims; the rest of the vector is FP8


def v4_rope_dim(dim: int) -> int | None:
    """The RoPE split the FP8 V4 rows use at this dim (None: the dim does not fit it)."""
    for rope in (V4_ROPE_DIM, 0):
        if dim > rope and (dim - rope) % formats.layout.FP8_V4_TILE == 0:
            return rope
    return None


def codecs_for(dim: int) -> tuple[str, ...]:
    return tuple(c for c in CODECS if c != "fp8_v4" or v4_rope_dim(dim) is not None)


def _quant(name, dim):
    """quantize(x, reference=False) -> the stored tensors, as a tuple for every codec."""
    if name == "fp8_v4":
        rope = v4_rope_dim(dim)
        return lambda x, reference=False: (formats.quantize_fp8_v4(x, rope_dim=rope,
                                                                   reference=reference),)
    return getattr(formats, f"quantize_{name}")


def _dequant(name, dim):
    """dequantize(*stored, reference=False) -> float32 values."""
    if name == "fp8_v4":
        rope = v4_rope_dim(dim)
        return lambda e, reference=False: formats.dequantize_fp8_v4(
            e, head_dim=dim, rope_dim=rope, reference=reference)
    return getattr(formats, f"dequantize_{name}")


def time_fn(fn, device: str, repeat: int, warmup: int = 2) -> float:
    """Median seconds per call (CUDA events on a GPU, perf_counter on the CPU)."""
    if device == "cuda":
        return time_cuda(fn, repeat=repeat, warmup=warmup)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def moved_bytes(name: str, rows: int, dim: int) -> dict[str, int]:
    """Bytes a codec must read and write at least: float32 values and the stored form."""
    if name == "fp8_v4":
        stored = rows * formats.layout.fp8_v4_layout(dim, v4_rope_dim(dim)).entry_bytes
    else:
        stored = rows * formats.layout.BLOCK_FORMATS[name].bytes(dim)
    return {"quantize": 4 * rows * dim + stored, "dequantize": stored + 4 * rows * dim}


def same_bits(a, b) -> bool:
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype != torch.uint8 else t  # noqa: E731
    return all(torch.equal(as_bytes(x.cpu()), as_bytes(y.cpu())) for x, y in zip(a, b))


def bench_cpu(rows: int, dim: int, repeat: int, refcheck: bool) -> list[dict]:
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    out = []
    for name in codecs_for(dim):
        q, dq = _quant(name, dim), _dequant(name, dim)
        stored = q(x)
        if refcheck:
            assert same_bits(stored, q(x, reference=True)), f"{name}: op != reference"
        for op, fast, ref in (
            ("quantize", lambda: q(x), lambda: q(x, reference=True)),
            ("dequantize", lambda: dq(*stored), lambda: dq(*stored, reference=True)),
        ):
            t_fast = time_fn(fast, "cpu", repeat)
            t_ref = time_fn(ref, "cpu", max(1, repeat // 3))
            nbytes = moved_bytes(name, rows, dim)[op]
            row = {"device": "cpu", "codec": name, "op": op, "values": x.numel(),
                   "op_s": t_fast, "reference_s": t_ref, "speedup_vs_reference": t_ref / t_fast,
                   "op_GBps": nbytes / t_fast / 1e9}
            out.append(row)
            print(f"  cpu  {name:8s} {op:10s} op {t_fast * 1e3:8.2f} ms  ref {t_ref * 1e3:8.2f} ms"
                  f"  x{row['speedup_vs_reference']:.1f}  {row['op_GBps']:.2f} GB/s", file=sys.stderr)
    return out


def bench_cuda(rows: int, dim: int, repeat: int, refcheck: bool) -> list[dict]:
    x = torch.randn(rows, dim, device="cuda")
    out = []
    for name in codecs_for(dim):
        q, dq = _quant(name, dim), _dequant(name, dim)
        stored = q(x)
        if refcheck:
            assert same_bits(stored, q(x.cpu())), f"{name}: CUDA != CPU op"
        for op, fn in (("quantize", lambda: q(x)), ("dequantize", lambda: dq(*stored))):
            nbytes = moved_bytes(name, rows, dim)[op]
            # Baseline: a device-to-device copy moving the same number of bytes (read + write).
            buf = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(buf)
            t_copy = time_fn(lambda: dst.copy_(buf), "cuda", repeat)
            t_op = time_fn(fn, "cuda", repeat)
            row = {"device": "cuda", "codec": name, "op": op, "values": x.numel(), "op_s": t_op,
                   "copy_same_bytes_s": t_copy, "op_GBps": nbytes / t_op / 1e9,
                   "copy_GBps": 2 * buf.numel() / t_copy / 1e9,
                   "fraction_of_copy_bandwidth": t_copy / t_op}
            out.append(row)
            print(f"  cuda {name:8s} {op:10s} {t_op * 1e6:8.1f} us  {row['op_GBps']:7.1f} GB/s"
                  f"  = {row['fraction_of_copy_bandwidth']:.2f} of copy ({row['copy_GBps']:.0f} GB/s)",
                  file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                   help="cpu, cuda, or all (cuda only where a GPU is present; default)")
    p.add_argument("--rows", type=int, default=None, help="vectors to code (default 4096 CPU, 262144 GPU)")
    p.add_argument("--dim", type=int, default=512, help="vector length (default 512, the V4.1 head dim)")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--no-refcheck", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the results here too")
    args = p.parse_args(argv)

    results = []
    if args.device in ("cpu", "all"):
        print(f"CPU, {args.rows or 4096} x {args.dim}:", file=sys.stderr)
        results += bench_cpu(args.rows or 4096, args.dim, args.repeat, not args.no_refcheck)
    if args.device in ("cuda", "all"):
        if torch.cuda.is_available():
            print(f"CUDA ({torch.cuda.get_device_name()}), {args.rows or 262144} x {args.dim}:",
                  file=sys.stderr)
            results += bench_cuda(args.rows or 262144, args.dim, args.repeat, not args.no_refcheck)
        elif args.device == "cuda":
            p.error("--device cuda: no CUDA GPU is available")
    report = {
        "benchmark": "codecs",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "build": dsv41.build_info(),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
