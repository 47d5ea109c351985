"""Shared pieces of the kernel benchmarks (bench_attention.py, bench_topk.py, bench_copy.py):
timing with CUDA events, the H200 ceilings of docs/design.md#hardware next to ceilings
measured in the same run, the JSON report, and a clean exit where there is no GPU."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from _meta import git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

# docs/design.md#hardware: datasheet figures, and the device-copy and matmul figures it
# gives as typical measurements (the keys keep their old "spec" names: reports use them).
H200 = {
    "hbm_TBps_datasheet": 4.8,
    "hbm_copy_TBps_spec_measured": 4.3,
    "bf16_dense_TFLOPs_datasheet": 989.0,
    "bf16_dense_TFLOPs_spec_measured": 790.0,
    "pcie_GBps_per_direction": 52.0,
}


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cuda"], default="cuda",
                   help="cuda (the kernels are CUDA only; without a GPU the script says so and exits 0)")
    p.add_argument("--json", metavar="PATH", help="write the report here too")
    p.add_argument("--refcheck", dest="refcheck", action="store_true", default=True,
                   help="check results against the reference before timing (default)")
    p.add_argument("--no-refcheck", dest="refcheck", action="store_false")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    return p


def require_gpu(name: str, args) -> bool:
    """False (after printing why and writing a 'skipped' report) when no GPU is usable."""
    if torch.cuda.is_available():
        return True
    msg = f"{name}: --device cuda: no CUDA GPU is available on this machine; nothing was timed"
    print(msg, file=sys.stderr)
    if args.json:
        write_report(args.json, {"benchmark": name, "skipped": msg})
    return False


def time_cuda(fn, repeat: int = 50, warmup: int = 5) -> float:
    """Median seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3)
    return statistics.median(samples)


def time_cuda_graph(fn, repeat: int = 50, inner: int = 20) -> float:
    """Median seconds per call of `inner` calls captured in one CUDA graph (hides launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    return time_cuda(g.replay, repeat=repeat, warmup=3) / inner


def _copy_TBps() -> float:
    n = 1 << 29  # 512 MiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * n / time_cuda(lambda: dst.copy_(src), repeat=20) / 1e12


def _bf16_matmul_TFLOPs() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / time_cuda(lambda: a @ b, repeat=20) / 1e12


def measured_ceilings() -> dict:
    """A device-to-device copy (bytes read + written) and a bf16 matmul, in this run."""
    out = {"copy_TBps": _copy_TBps(), "bf16_matmul_TFLOPs": _bf16_matmul_TFLOPs()}
    torch.cuda.empty_cache()  # the helpers' buffers are gone with their frames
    return out


def report(name: str, results, extra: dict | None = None) -> dict:
    import dsv41

    return {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "build": dsv41.build_info(),
        "h200_spec": H200,
        **(extra or {}),
        "results": results,
    }


def write_report(path: str | None, rep: dict) -> None:
    text = json.dumps(rep, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)
